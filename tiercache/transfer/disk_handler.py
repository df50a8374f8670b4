"""`DiskHandler`: transfers through a tier's `read`/`write`/`read_to`, in host memory.

For the tiers that have no pool tensor (NVMe, LMDB) and for tier-to-tier copies (demotions
and write-backs, ordinary jobs here):
- tier -> tier: `src.read` into a staging buffer, `dst.write` of the rows that arrived;
- engine -> tier: `KVLayout.gather` into the staging buffer, `tier.write`;
- tier -> engine on a CPU engine: `tier.read_to`, whose sink scatters each stretch of verified
  rows into the engine's blocks from where the tier hands them over (NVMe: its aligned read
  buffer, `Tier.reads_in_place`; other tiers: the staging buffer);
- tier -> engine on a CUDA engine: `tier.read` into the pinned staging buffer, then
  `KVLayout.scatter` of the rows that arrived (each chunk synchronized before the buffer is
  reused): the host -> device copy wants a pinned host source.
It works on any `Tier`. `threads` per lane, one lane per tier for engine transfers and one per
pair of tiers for copies, so a tier that hangs stalls only jobs that touch it; the worker's
dependencies order jobs that touch the same slots. Cancellation (`Job.cancel`): each chunk is
gathered or scattered under the job's fence only while the job is not cancelled, so an
abandoned load never writes engine blocks later, and vLLM may reuse a cancelled store's blocks.
Staging buffers are per thread, bounded by `chunk_bytes`, pinned with CUDA.
A failed or corrupt read fails only its blocks: a move still lands the rest, and a block that
did not arrive is never written anywhere. Failed blocks a shared store no longer held are
reported apart (`Job.gone`, sorted by `Tier.sort_failed` on the reading thread): plain misses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from tiercache.errors import IO_ERRORS
from tiercache.tiers import Tier
from tiercache.transfer.handler import EXPEDITED, LaneHandler, check_ranges, tier_of
from tiercache.transfer.job import Job
from tiercache.transfer.kv_layout import KVLayout
from tiercache.transfer.specs import GPULoadStoreSpec, TierLoadStoreSpec

# `IO_ERRORS` (tiercache.errors), a tier's failed I/O, fail the chunk's blocks. Anything else
# is a bug and fails the whole job (logged by the lane).
__all__ = ["IO_ERRORS", "DiskHandler"]


class _Cancelled(Exception):
    """Raised by a load's sink once its job is cancelled: `Tier.read_to` stops reading."""


class DiskHandler(LaneHandler):
    """Tier <-> tier and engine <-> tier through host memory, on a pool of threads."""

    cancellable = True  # `Job.cancel` is honoured between chunks (see the module doc)

    def __init__(
        self,
        tiers: Sequence[Tier],
        layout: KVLayout | None = None,
        *,
        threads: int = 2,
        chunk_bytes: int = 64 * 2**20,
        name: str = "disk",
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads: expected >= 1, got {threads}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: expected >= 1, got {chunk_bytes}")
        self.layout = layout
        self._tiers = list(tiers)
        self._chunk_bytes = chunk_bytes
        self._cuda = layout is not None and layout.device.type == "cuda"
        self._pin = torch.cuda.is_available()
        self._local = threading.local()
        super().__init__({}, name=name, lane_threads=threads)

    def lane_of(self, job: Job) -> str:
        src, dst = job.src, job.dst
        if isinstance(src, TierLoadStoreSpec) and isinstance(dst, TierLoadStoreSpec):
            return f"io:{src.medium}>{dst.medium}"
        return f"io:{(src if isinstance(src, TierLoadStoreSpec) else dst).medium}"

    def background(self, lane: str) -> bool:
        return ">" in lane  # tier -> tier: demotions and write-backs, nothing waits on them

    def expedited_lane_of(self, job: Job) -> str:
        return f"{EXPEDITED}:{self.lane_of(job)}"

    def check(self, job: Job) -> None:
        sides = [s for s in (job.src, job.dst) if isinstance(s, TierLoadStoreSpec)]
        if not sides:
            raise ValueError(f"job {job.job_id}: no tier side")
        tiers = [tier_of(self._tiers, s) for s in sides]
        for t, s in zip(tiers, sides, strict=True):
            check_ranges(job, t, s, self.layout.num_blocks if self.layout else 0)
        if len(sides) == 2:
            if len(sides[0].slots) != len(sides[1].slots):
                raise ValueError(
                    f"job {job.job_id}: {len(sides[0].slots)} source slots but "
                    f"{len(sides[1].slots)} destination slots"
                )
            if tiers[0].block_bytes != tiers[1].block_bytes:
                raise ValueError(
                    f"job {job.job_id}: block sizes differ "
                    f"({tiers[0].block_bytes} != {tiers[1].block_bytes})"
                )
            return
        if self.layout is None:
            raise ValueError(f"job {job.job_id}: engine transfers need a KVLayout")
        if tiers[0].block_bytes != self.layout.block_bytes:
            raise ValueError(
                f"tier {tiers[0].medium!r}: blocks of {tiers[0].block_bytes} bytes, "
                f"but the KV layout's offloaded block is {self.layout.block_bytes}"
            )
        eng = job.src if isinstance(job.src, GPULoadStoreSpec) else job.dst
        assert isinstance(eng, GPULoadStoreSpec)
        if len(eng.block_ids) != len(sides[0].slots) * self.layout.factor:
            raise ValueError(
                f"job {job.job_id}: {len(eng.block_ids)} engine blocks for "
                f"{len(sides[0].slots)} slots"
            )

    def prepare(self, job: Job) -> None:
        if self._cuda and (
            isinstance(job.src, GPULoadStoreSpec) or isinstance(job.dst, GPULoadStoreSpec)
        ):
            assert self.layout is not None
            job.compute_event = torch.cuda.current_stream(self.layout.device).record_event()

    # -- the work --------------------------------------------------------------------------
    def _staging(self, rows: int, block_bytes: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != block_bytes:
            buf = torch.empty((rows, block_bytes), dtype=torch.uint8, pin_memory=self._pin)
            self._local.buf = buf
        return buf[:rows]

    def _stream(self) -> torch.cuda.Stream:
        s = getattr(self._local, "stream", None)
        if s is None:
            assert self.layout is not None
            s = self._local.stream = torch.cuda.Stream(self.layout.device)
        return s

    def run(self, job: Job, lane: str) -> None:
        t0 = time.perf_counter()
        src, dst = job.src, job.dst
        tier_side = src if isinstance(src, TierLoadStoreSpec) else dst
        assert isinstance(tier_side, TierLoadStoreSpec)
        bb = tier_of(self._tiers, tier_side).block_bytes
        n = len(tier_side.slots)
        f = self.layout.factor if self.layout is not None else 1
        step = max(1, min(n, self._chunk_bytes // bb))
        failed: list[int] = []
        gone: list[int] = []
        if self._cuda and job.compute_event is not None:
            self._stream().wait_event(job.compute_event)
        # A CUDA engine keeps the staged path: its DMA wants the pinned staging buffer.
        load_in_place = (
            isinstance(src, TierLoadStoreSpec)
            and isinstance(dst, GPULoadStoreSpec)
            and not self._cuda
        )
        for a in range(0, n, step):
            b = min(n, a + step)
            if job.cancelled:  # the engine gave up on it: read nothing more
                failed.extend(range(a, n))
                break
            if load_in_place:  # one copy: the tier's verified rows -> engine blocks
                failed.extend(a + i for i in self._load(job, a, b, gone))
                if b == n:
                    job.read_done.set()
                if job.cancelled:
                    failed.extend(range(b, n))
                    break
                continue
            buf = self._staging(b - a, bb)
            # 1. source -> staging; `bad` are chunk positions whose bytes did not arrive.
            if isinstance(src, TierLoadStoreSpec):
                tier = tier_of(self._tiers, src)
                try:
                    bad = set(tier.read(src.slots[a:b], buf, src.keys[a:b]))
                except IO_ERRORS:
                    bad = set(range(b - a))
                gone.extend(a + i for i in tier.sort_failed(src.keys[a:b], bad)[0])
            else:
                with job.fence:  # after Job.cancel, no engine byte is read (vLLM reuses them)
                    if job.cancelled:
                        failed.extend(range(a, n))
                        break
                    self._engine_copy(self.layout.gather, src.block_ids[a * f : b * f], buf)
                bad = set()
            if b == n:  # every source byte read: jobs that only overwrite them may start
                job.read_done.set()
            good = [i for i in range(b - a) if i not in bad]
            failed.extend(a + i for i in sorted(bad))
            if not good:
                continue
            rows = buf if not bad else buf.index_select(0, torch.tensor(good, dtype=torch.int64))
            # 2. staging -> destination, only the rows that arrived.
            if isinstance(dst, TierLoadStoreSpec):
                try:
                    tier_of(self._tiers, dst).write(
                        [dst.slots[a + i] for i in good], rows, [dst.keys[a + i] for i in good]
                    )
                except IO_ERRORS:
                    failed.extend(a + i for i in good)
            else:
                ids = [dst.block_ids[(a + i) * f + j] for i in good for j in range(f)]
                with job.fence:  # after Job.cancel, no byte reaches the engine
                    if job.cancelled:
                        failed.extend(a + i for i in good)
                    else:
                        self._engine_copy(self.layout.scatter, ids, rows)
        job.size = (n - len(failed)) * bb
        if failed:
            job.fail(tuple(sorted(failed)))
            job.gone = tuple(gone)
        job.time = time.perf_counter() - t0

    def _load(self, job: Job, a: int, b: int, gone: list[int]) -> list[int]:
        """Chunk a..b of a tier -> engine job on a CPU engine, through `Tier.read_to`: each
        stretch of verified rows is scattered into the engine blocks from wherever the tier
        hands it over (NVMe: its aligned read buffer, so the bytes are copied once), under
        the job's fence. The chunk positions (0-based) that did not land; gone ones (a
        shared store's misses) are added to `gone`, as job positions."""
        src, dst = job.src, job.dst
        assert isinstance(src, TierLoadStoreSpec) and isinstance(dst, GPULoadStoreSpec)
        assert self.layout is not None
        layout, f = self.layout, self.layout.factor
        tier = tier_of(self._tiers, src)
        landed: set[int] = set()

        def sink(positions: list[int], rows: torch.Tensor) -> None:
            ids = [dst.block_ids[(a + i) * f + j] for i in positions for j in range(f)]
            with job.fence:  # after Job.cancel, no byte reaches the engine
                if job.cancelled:
                    raise _Cancelled  # stops the read: nothing more is wanted
                layout.scatter(ids, rows)
            landed.update(positions)

        staging = None if tier.reads_in_place else self._staging(b - a, tier.block_bytes)
        keys = src.keys[a:b]
        try:
            bad = tier.read_to(src.slots[a:b], sink, keys, staging=staging)
        except IO_ERRORS:
            bad = [i for i in range(b - a) if i not in landed]
        except _Cancelled:
            bad = []
        # Sorted on the thread that read (module doc: `Job.gone`).
        gone.extend(a + i for i in tier.sort_failed(keys, bad)[0])
        return [i for i in range(b - a) if i not in landed]

    def _engine_copy(
        self, copy: Callable[..., None], block_ids: Sequence[int], buf: torch.Tensor
    ) -> None:
        """`copy` (the layout's `gather` or `scatter`) of one chunk; on CUDA on this thread's
        stream, synchronized: the tier reads the staging buffer next, or the next chunk
        reuses it."""
        if not self._cuda:
            copy(block_ids, buf)
            return
        s = self._stream()
        with torch.cuda.stream(s):
            copy(block_ids, buf, non_blocking=True)
        s.synchronize()
