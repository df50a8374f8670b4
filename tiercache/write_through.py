"""`WriteThroughCopier`: the `TierCache` facade's write-through copies, off the callers' path.

Write-through tiers (`write_policy`) get their copies from a thread of the cache,
`tiercache-write-through`: it plans a small batch under the facade's lock
(`OffloadingManager.plan_write_through`), copies without it (sources pinned, destinations
reserved: `PlanRunner.copy_chunk`) and completes under it. `flush` and `close` run what is
still queued with `run`. The facade's events pass through `tap_events` (a callback, so this
module does not import the facade). Logs as "tiercache.cache".

Lock order: `io` (held for a whole batch, so `flush` waits for the batch in flight) before the
facade's lock, never the other way round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tiercache.manager import OffloadingManager
from tiercache.plan_runner import PlanRunner, chunks
from tiercache.priority import lower_this_thread
from tiercache.records import BlockMove

log = logging.getLogger("tiercache.cache")

THROUGH_BATCH = 32  # write-through copies planned at once, at most
THROUGH_YIELD_S = 0.001  # the copier's pause between batches (the engine's thread runs)
THROUGH_PIN_SHARE = 16  # ... and at most 1/16 of the first tier's blocks
THROUGH_POLL_S = 0.2  # the copier also looks for work this often (adapters store directly)


class WriteThroughCopier:
    """Runs a manager's queued write-through copies, on its own thread or when asked."""

    def __init__(
        self,
        manager: OffloadingManager,
        runner: PlanRunner,
        lock: threading.RLock,
        *,
        first_capacity: int,
        block_bytes: int,
        tap_events: Callable[[], None],
        closed: Callable[[], bool],
        thread: bool,
    ) -> None:
        """`lock`: the facade's lock; `first_capacity`: the first tier's blocks (a batch pins
        at most 1/THROUGH_PIN_SHARE of them); `tap_events`: the facade's event tap (lock
        held); `closed`: whether the facade is closed (the thread then ends); `thread`:
        start the copier thread (there are write-through tiers)."""
        self._manager = manager
        self._runner = runner
        self._lock = lock
        self._first_capacity = first_capacity
        self._block_bytes = block_bytes
        self._tap_events = tap_events
        self._closed = closed
        self.wake_event = threading.Event()
        self.io = threading.Lock()  # see the module doc: held for a whole batch
        # (destination tier, monotonic start) of the write-through copy running (check)
        self._busy: tuple[int, float] | None = None
        self.thread: threading.Thread | None = None
        if thread:
            self.thread = threading.Thread(
                target=self._loop, name="tiercache-write-through", daemon=True
            )
            self.thread.start()

    def wake(self) -> None:
        """Start the copies now; a no-op without the thread."""
        if self.thread is not None:
            self.wake_event.set()

    def _loop(self) -> None:
        """The copier thread: run queued write-through copies until the cache closes.

        The copies are insurance against a crash and must not slow the engine they run
        beside: the thread copies small batches and sleeps briefly between them, so it never
        holds the GIL (or the cache lock) for long while the engine's thread waits for it.
        What it cannot keep up with is dropped and counted. It runs at a lower priority
        than the engine's threads (`tiercache.priority`)."""
        lower_this_thread()
        while not self._closed():
            self.wake_event.wait(THROUGH_POLL_S)
            self.wake_event.clear()
            try:
                while not self._closed() and self.run(THROUGH_BATCH):
                    time.sleep(THROUGH_YIELD_S)
            except Exception:  # the thread must survive a bug in one batch
                log.exception("write-through failed")

    def run(self, limit: int) -> bool:
        """Plan up to `limit` write-through copies and run them; False when none was queued.
        The I/O runs outside the facade's lock (the sources are pinned and the destinations
        reserved until the copies complete), under `io`: call it without holding that lock."""
        with self.io:
            with self._lock:
                # A small share of the first tier at a time: a copy pins its source block, and
                # pinned blocks can be neither evicted nor replaced by new stores.
                room = max(1, self._first_capacity // THROUGH_PIN_SHARE)
                moves = self._manager.plan_write_through(min(limit, room))
            for move in moves:
                self._run_move(move)
        return bool(moves)

    def _run_move(self, move: BlockMove) -> None:
        """Copy one write-through move (no lock held) and complete it, whatever happens."""
        ok: list[bytes] = []
        errors: dict[int, int] = {}
        self._busy = (move.dst.tier, time.monotonic())  # see check
        try:
            for keys, src_slots, dst_slots in chunks(move, self._block_bytes):
                got, errs = self._runner.copy_chunk(
                    keys, move.src.tier, src_slots, move.dst.tier, dst_slots
                )
                ok += got
                for t, n in errs.items():
                    errors[t] = errors.get(t, 0) + n
        finally:  # every copy is completed and its source unpinned
            self._busy = None
            with self._lock:
                self._runner.finish_copy(
                    move.keys, ok, errors, self._manager.complete_write_through
                )
                self._tap_events()

    def check(self, timeout: float) -> int | None:
        """The write-through copy in progress, if it has run `timeout` seconds or more: its
        destination tier hung, so it is suspended (the manager plans no copy, store or
        write-back into it until the back-off ends). Returns that tier's index, else None.
        Cheap: an engine calls it every step."""
        busy = self._busy
        if busy is None or time.monotonic() - busy[1] < timeout:
            return None
        with self._lock:
            self._manager.suspend(busy[0])
        return busy[0]
