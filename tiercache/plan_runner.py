"""`PlanRunner`: runs the manager's plans on the tiers, for the `TierCache` facade.

It does the I/O of a plan and completes its keys on the manager, whatever happens:
- `run_plan`: a store plan's moves in order, then its writes (first tier, then write-around);
- `move` (`copy_chunk`, then `finish_copy`): tier-to-tier copies (demotions, write-backs,
  write-through) through host staging in bounded chunks, or in place from host memory
  (`host_runs`);
- `read_group` / `complete_load` / `end_load`: one tier's share of a load, and its end (bad
  blocks dropped and counted, unreachable tiers suspended).

It holds no lock of its own: the facade's lock is held where a method says so, and
`reads_done` (a condition on that lock) is notified when a load ends, so a copy or a store
into a slot that a read of a leaving block pins goes on (`wait_slots`). `run_plan` and
`move` take that lock for each completion, so they run with it held or without it (a
store whose moves demote leaving blocks: their reads go on meanwhile). Failed tier I/O
(`IO_ERRORS`) fails the blocks it touched and is counted; anything else propagates. Logs as
"tiercache.cache".
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from tiercache.errors import IO_ERRORS
from tiercache.manager import OffloadingManager
from tiercache.records import BlockMove, PrepareStoreOutput
from tiercache.tiers import Tier
from tiercache.tiers.pool import PoolTier

log = logging.getLogger("tiercache.cache")

MOVE_CHUNK_BYTES = 64 * 2**20  # staging per step of a tier-to-tier copy
READS_POLL_S = 0.05  # a write into a busy slot (`wait_slots`) looks again this often

# Errors that say a tier cannot be reached at all (a stopped or lost server), not that some
# of its blocks failed: the tier is suspended (`CircuitBreaker`).
UNREACHABLE_ERRNOS = frozenset(
    {
        errno.ETIMEDOUT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EAGAIN,  # a tier in its own back-off (e.g. Redis after a timeout)
    }
)


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says its tier cannot be reached at all."""
    return isinstance(exc, TimeoutError | ConnectionError) or (
        isinstance(exc, OSError) and exc.errno in UNREACHABLE_ERRNOS
    )


def rows_of(blocks: torch.Tensor, keys: Sequence[bytes], wanted: Sequence[bytes]) -> torch.Tensor:
    """The rows of `blocks` (one per key of `keys`) for `wanted`, a subsequence of `keys`."""
    if len(wanted) == len(keys):
        return blocks
    pos = {k: i for i, k in enumerate(keys)}
    idx = torch.tensor([pos[k] for k in wanted], dtype=torch.int64, device=blocks.device)
    return blocks.index_select(0, idx)


def chunks(
    move: BlockMove, block_bytes: int
) -> Iterator[tuple[tuple[bytes, ...], tuple[int, ...], tuple[int, ...]]]:
    """(keys, source slots, destination slots) of `move`, in chunks of bounded staging."""
    step = max(1, MOVE_CHUNK_BYTES // block_bytes)
    for a in range(0, len(move.keys), step):
        yield move.keys[a : a + step], move.src.slots[a : a + step], move.dst.slots[a : a + step]


def host_runs(tier: Tier, slots: Sequence[int]) -> list[tuple[int, int]] | None:
    """[a, b) index ranges of `slots` that are runs of consecutive slots, when `tier` is a
    pool in host memory and the runs are few (at most one per 8 blocks, so a scattered copy
    does not become many small writes below); else None (copy through staging)."""
    if not isinstance(tier, PoolTier) or tier.device.type != "cpu" or not slots:
        return None
    runs, a = [], 0
    for i in range(1, len(slots)):
        if slots[i] != slots[i - 1] + 1:
            runs.append((a, i))
            a = i
    runs.append((a, len(slots)))
    return runs if len(runs) <= max(1, len(slots) // 8) else None


class PlanRunner:
    """Runs plans, copies and loads of one manager over its tiers (see the module doc)."""

    def __init__(
        self,
        manager: OffloadingManager,
        tiers: Sequence[Tier],
        block_bytes: int,
        reads_done: threading.Condition,
    ) -> None:
        self._manager = manager
        self._tiers = list(tiers)
        self._block_bytes = block_bytes
        self._reads_done = reads_done

    # -- store plans -----------------------------------------------------------------------
    def run_plan(
        self, plan: PrepareStoreOutput, blocks: torch.Tensor, keys: Sequence[bytes]
    ) -> None:
        """Run a store plan to its completion, the lock held or not (each completion takes
        it): its moves in order, then its writes (first tier, then write-around) of the rows
        of `blocks` (one per key of `keys`), each once its slots are not busy (`wait_slots`:
        a leaving block's source slot is written once its move ended and its reads did).

        A failed tier write fails that write (a counted error). Anything else raised on the
        way (a bug, a device mismatch, out of memory) first completes every key of the plan
        not completed yet with success=False, then propagates: the reserved slots go back,
        no key is left "moving", and the same keys can be stored again.
        """
        try:
            for move in plan.moves:
                self.move(move)
            for w in plan.writes():
                tier = self._tiers[w.spec.tier]
                src = rows_of(blocks, keys, w.keys)
                self.wait_slots(w.spec.tier, w.spec.slots)
                try:
                    tier.write(w.spec.slots, src, w.keys)
                except IO_ERRORS as exc:
                    log.warning(
                        "store of %d blocks into %s failed: %s", len(w.keys), tier.medium, exc
                    )
                    with self._reads_done:
                        self._manager.record_error(w.spec.tier)
                        self._manager.complete_store(w.keys, success=False)
                    continue
                with self._reads_done:
                    self._manager.complete_store(w.keys, success=True)
        except BaseException:
            # complete_store skips keys already completed (moves and writes that finished),
            # so this fails exactly what is still in flight.
            with self._reads_done:
                for move in plan.moves:
                    self._manager.complete_store(move.keys, success=False)
                self._manager.complete_store(plan.stored_keys, success=False)
            raise

    # -- tier-to-tier copies ---------------------------------------------------------------
    def move(self, move: BlockMove) -> None:
        """Copy blocks between tiers through a host staging buffer, in bounded chunks, each
        completed on the manager (the lock held or not: each completion takes it)."""
        for keys, src_slots, dst_slots in chunks(move, self._block_bytes):
            ok, errors = self.copy_chunk(keys, move.src.tier, src_slots, move.dst.tier, dst_slots)
            with self._reads_done:
                self.finish_copy(keys, ok, errors, self._manager.complete_store)

    def wait_slots(self, tier: int, slots: Sequence[int]) -> None:
        """Return once no slot of `slots` in `tier` is busy (`OffloadingManager.reading`: a
        leaving block's source whose move still runs, or pinned by a read of one); the lock
        held or not (a wait releases it)."""
        if self._manager.reading(tier, slots):  # an unlocked hint; checked again locked
            with self._reads_done:
                while self._manager.reading(tier, slots):
                    # Polled too: an adapter may unpin on the manager itself, not notifying.
                    self._reads_done.wait(READS_POLL_S)

    def finish_copy(
        self,
        keys: Sequence[bytes],
        ok: list[bytes],
        errors: dict[int, int],
        complete: Callable[..., None],
    ) -> None:
        """Count a copy's failures per tier and complete its keys with `complete`: those
        that arrived, then the rest as failed (lock held)."""
        for t, n in errors.items():
            self._manager.record_error(t, n)
        complete(ok, success=True)
        done = set(ok)
        bad = [k for k in keys if k not in done]
        if bad:
            complete(bad, success=False)

    def copy_chunk(
        self,
        keys: tuple[bytes, ...],
        src: int,
        src_slots: tuple[int, ...],
        dst: int,
        dst_slots: tuple[int, ...],
    ) -> tuple[list[bytes], dict[int, int]]:
        """Copy blocks between two tiers through host staging (I/O only, no bookkeeping):
        the keys that arrived, and failures to count per tier. A destination slot that a
        read of a leaving block still reads (a write-through copy into the slot of a block
        its batch moved down) is written once that read ends (`wait_slots`)."""
        self.wait_slots(dst, dst_slots)
        src_tier, dst_tier = self._tiers[src], self._tiers[dst]
        errors: dict[int, int] = {}

        def write(slots: Sequence[int], rows: torch.Tensor, ks: Sequence[bytes]) -> bool:
            try:
                dst_tier.write(slots, rows, ks)
            except IO_ERRORS as exc:
                what = f"copy of {len(ks)} blocks {src_tier.medium} -> {dst_tier.medium}"
                log.warning("%s failed: %s", what, exc)
                errors[dst] = errors.get(dst, 0) + 1
                return False
            return True

        runs = host_runs(src_tier, src_slots)
        if runs is not None:
            # The source rows are host memory already: the destination reads them in place
            # (the callers pin the sources or hold the lock, so nothing rewrites them now).
            pool = src_tier.pool  # type: ignore[attr-defined]
            done: list[bytes] = []
            for a, b in runs:
                if write(dst_slots[a:b], pool[src_slots[a] : src_slots[a] + b - a], keys[a:b]):
                    done += keys[a:b]
            return done, errors
        staging = torch.empty((len(keys), self._block_bytes), dtype=torch.uint8)
        try:
            failed = set(src_tier.read(src_slots, staging, keys))
        except IO_ERRORS as exc:
            log.warning("read of %d blocks from %s failed: %s", len(keys), src_tier.medium, exc)
            failed = set(range(len(keys)))
        bad = src_tier.sort_failed(keys, failed)[1]  # gone from a shared store: no error
        if bad:
            errors[src] = len(bad)
        good = [i for i in range(len(keys)) if i not in failed]
        # Only rows that read back verified are written: a failed row's staging bytes are
        # garbage and must never reach a slot that would later be served.
        if not good:
            return [], errors
        rows = staging if len(good) == len(keys) else staging[good]
        good_keys = [keys[i] for i in good]
        ok = write([dst_slots[i] for i in good], rows, good_keys)
        return (good_keys if ok else []), errors

    # -- loads -----------------------------------------------------------------------------
    def read_group(
        self,
        tier: Tier,
        slots: Sequence[int],
        positions: Sequence[int],
        keys: Sequence[bytes],
        out: torch.Tensor,
        down: set[int],
    ) -> list[int]:
        """Read one tier's share of a load into `out` (no lock needed: the blocks are
        pinned); returns failed positions (into out). A read that fails as a whole adds the
        tier's index to `down`."""
        p0 = positions[0]
        contiguous = positions[-1] - p0 == len(positions) - 1
        dst = (
            out[p0 : p0 + len(positions)]
            if contiguous
            else torch.empty((len(positions), self._block_bytes), dtype=torch.uint8)
        )
        try:
            failed = tier.read(slots, dst, keys)
        except IO_ERRORS as exc:
            log.warning("read of %d blocks from %s failed: %s", len(slots), tier.medium, exc)
            if unreachable(exc):
                down.add(self._tiers.index(tier))
            return list(positions)
        if not contiguous:  # indices live on the device of the tensor they index
            idx = torch.tensor(positions, dtype=torch.int64, device=out.device)
            out.index_copy_(0, idx, dst.to(out.device))
        return [positions[i] for i in failed]

    def complete_load(self, chain: list[bytes]) -> None:
        """Unpin a load (lock held); a copy waiting for its read of a leaving block goes on."""
        self._manager.complete_load(chain)
        self._reads_done.notify_all()

    def end_load(self, chain: list[bytes], bad: dict[int, list[bytes]], down: set[int]) -> int:
        """Complete a load of `chain` whose reads failed on `bad` (per tier) and on the
        tiers in `down` (lock held): the bad blocks dropped and counted, unreachable tiers
        suspended. Returns how many leading blocks of `chain` are good."""
        self.complete_load(chain)
        for tier in down:
            # A tier that cannot be reached (a stopped server: each read waits out its
            # timeout) is skipped for its back-off: the next requests do not wait again.
            self._manager.suspend(tier)
        k = len(chain)
        for tier, bad_keys in bad.items():
            # Blocks the shared store evicted are plain misses (`Tier.sort_failed`).
            errors = self._tiers[tier].sort_failed(bad_keys, range(len(bad_keys)))[1]
            if errors:
                self._manager.record_error(tier, len(errors))
            # If another load pins them, it fails on them too and drops them.
            with contextlib.suppress(ValueError):
                self._manager.discard(bad_keys, tier)
            k = min(k, min(chain.index(b) for b in bad_keys))
        return k
