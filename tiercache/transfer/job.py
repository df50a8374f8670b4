"""`Job`: one submitted transfer as handlers see it (internal, mutable state).

A job is *issued* once its work has been started or done (`issued` is set): a host copy is then
finished, a CUDA copy is queued on a stream and finishes when `end_event` completes. Other
handlers order themselves after a job with `wait()` (host threads) or `end_event` (streams).

A job that touches engine blocks may be *cancelled* (`cancel()`) when the engine gives up
waiting for it (a load or a store past its deadline): a handler that supports it writes each
chunk into the engine, or reads it from there, under `fence` and only while `cancelled` is
unset, so once `cancel()` returns no byte of the job moves to or from the engine any more.
The job still runs to its end (a hung read or write cannot be interrupted) and is reported,
failed where its bytes did not arrive, like any other.
"""

from __future__ import annotations

import threading
from typing import Any

from tiercache.transfer.results import TransferResult, TransferType
from tiercache.transfer.specs import GPULoadStoreSpec, LoadStoreSpec, TierLoadStoreSpec

Resource = tuple[int, int]  # (tier index, slot), or (ENGINE, engine block id)
ENGINE = -1


class Flag:
    """A one-shot event: set once, then every `wait` returns at once. `threading.Event` with
    one lock instead of a Condition, made only when someone waits before it is set (a job
    makes two flags per submission, and a one-block decode-time store, issued at once, pays
    for them on the engine's thread)."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._set = False
        self._lock: threading.Lock | None = None  # held until set(): waiters block on it

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        set_flags(self)

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False if `timeout` seconds passed first."""
        if self._set:
            return True
        with _SETTING:
            if self._set:
                return True
            lock = self._lock
            if lock is None:
                lock = self._lock = threading.Lock()
                lock.acquire()
        if not lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return self._set
        lock.release()  # let the next waiter through
        return True


_SETTING = threading.Lock()


def set_flags(*flags: Flag) -> None:
    """`flag.set()` for each of `flags` in order, taking the setting lock once: a waiter
    that sees a later flag set sees the earlier ones set too, as with separate calls."""
    locks = []
    with _SETTING:  # against a second setter and a first waiter making the lock
        for flag in flags:
            if not flag._set:
                flag._set = True
                if flag._lock is not None:
                    locks.append(flag._lock)
    for lock in locks:  # outside the setting lock: a waiter then goes on
        lock.release()


class Job:
    """A transfer between two specs, its dependencies and its outcome."""

    __slots__ = (
        "cancelled",
        "compute_event",
        "deps",
        "dst",
        "end_event",
        "expedited",
        "failed",
        "fence",
        "gone",
        "issued",
        "job_id",
        "ok",
        "read_done",
        "reads",
        "size",
        "src",
        "start_event",
        "started",
        "time",
        "transfer_type",
        "writes",
    )

    def __init__(
        self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec, *, expedited: bool = False
    ) -> None:
        self.job_id = job_id
        self.expedited = expedited  # the engine waits for it: it skips the handler's FIFOs
        self.src = src
        self.dst = dst
        self.transfer_type: TransferType = (src.medium, dst.medium)
        self.reads: tuple[Resource, ...] = _resources(src)
        self.writes: tuple[Resource, ...] = _resources(dst)
        # (earlier job, whether its failure fails this one: True when this job reads its
        # bytes; None when this job only overwrites what it reads: it waits for `read_done`)
        self.deps: list[tuple[Job, bool | None]] = []
        self.compute_event: Any = None  # CUDA event on the caller's stream at submission
        self.start_event: Any = None  # a CUDA job's: the handler times it when it finishes
        self.end_event: Any = None
        self.issued = Flag()
        # Set once the job has read all its source bytes (at the latest when issued): a
        # later job that only overwrites what this one reads waits for this, not for its
        # write (a move into a hung disk has long read the slot a store now reuses).
        self.read_done = Flag()
        self.fence = threading.Lock()  # held by a handler while it touches engine blocks
        self.cancelled = False
        self.started = False  # a handler began its work (set under `fence`)
        self.ok = True
        self.failed: tuple[int, ...] = ()
        # Of `failed`, the positions a shared store no longer held (`Tier.sort_failed`):
        # plain misses, no error of the tier.
        self.gone: tuple[int, ...] = ()
        self.size = 0
        self.time = 0.0

    @property
    def num_blocks(self) -> int:
        """Offloaded blocks in the job (the tier side's slot count)."""
        side = self.src if isinstance(self.src, TierLoadStoreSpec) else self.dst
        assert isinstance(side, TierLoadStoreSpec)
        return len(side.slots)

    def fail(self, positions: tuple[int, ...] | None = None) -> None:
        """Mark the job unsuccessful: `positions` did not arrive (default: all of them)."""
        self.ok = False
        self.failed = tuple(range(self.num_blocks)) if positions is None else positions

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job's bytes are in place (or it failed); True if it succeeded.
        With `timeout` (seconds), False also when it has not finished by then (see `done`)."""
        if not self.issued.wait(timeout):
            return False
        if self.end_event is not None:
            self.end_event.synchronize()
        return self.ok

    def wait_reads(self) -> None:
        """Block until the job has read all its source bytes (a CUDA job: until its queued
        copies have run, as reads on a stream end only then)."""
        self.read_done.wait()
        if self.end_event is not None:
            self.end_event.synchronize()

    def cancel(self, *, unstarted_only: bool = False) -> bool:
        """Stop the job touching engine blocks: when this returns True, none of its chunks is
        being copied to or from the engine and none will be (the handler checks `cancelled`
        under `fence`). `unstarted_only` (a handler that cannot stop a job half way): cancel
        only a job still queued or waiting for its dependencies; False if it started."""
        with self.fence:
            if unstarted_only and self.started:
                return False
            self.cancelled = True
            return True

    def done(self) -> bool:
        """Finished, without blocking."""
        return self.issued.is_set() and (self.end_event is None or self.end_event.query())

    def result(self) -> TransferResult:
        return TransferResult(
            self.job_id, self.ok, self.size, self.time, self.transfer_type, self.failed, self.gone
        )


def _resources(spec: LoadStoreSpec) -> tuple[Resource, ...]:
    if isinstance(spec, GPULoadStoreSpec):
        where, ids = ENGINE, spec.block_ids
    else:
        where, ids = spec.tier, spec.slots
    if len(ids) == 1:  # a decode-time job: no list to build
        return ((where, ids[0]),)
    return tuple([(where, i) for i in ids])
