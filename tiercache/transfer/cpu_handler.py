"""`CPUCopyHandler`: engine KV buffer <-> pool tiers (`CPUTier`, `GPUTier`), the CPU path.

One lane per direction ("store": engine -> tier, "load": tier -> engine), each served by one
thread, so `transfer_async` never blocks and jobs of one direction finish in order. The bytes
move between the engine's layers and the tier's `pool` tensor directly (no staging), through
`KVLayout`: one batched copy per distinct allocation, not per layer or block. A CPU-tier hit
is one copy (`KVLayout.copy_from_pool`: pool rows -> engine blocks, split with a helper thread
when large) and no verification pass: pool tiers hold volatile memory and keep no checksum.
`CUDACopyHandler` is this class with a CUDA stream per lane.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from tiercache.tiers import Tier
from tiercache.transfer.handler import LaneHandler, check_ranges, tier_of
from tiercache.transfer.job import Job
from tiercache.transfer.kv_layout import KVLayout, per_pool
from tiercache.transfer.specs import GPULoadStoreSpec, TierLoadStoreSpec


def engine_sides(job: Job) -> tuple[GPULoadStoreSpec, TierLoadStoreSpec, bool]:
    """(engine spec, tier spec, is_store) of an engine <-> tier job; ValueError otherwise."""
    src, dst = job.src, job.dst
    if isinstance(src, GPULoadStoreSpec) and isinstance(dst, TierLoadStoreSpec):
        return src, dst, True
    if isinstance(src, TierLoadStoreSpec) and isinstance(dst, GPULoadStoreSpec):
        return dst, src, False
    raise ValueError(
        f"job {job.job_id}: expected an engine <-> tier transfer, got "
        f"{type(src).__name__} -> {type(dst).__name__}"
    )


class CPUCopyHandler(LaneHandler):
    """Engine blocks <-> rows of a pool tier, on one thread per direction."""

    def __init__(self, layout: KVLayout, tiers: Sequence[Tier], *, name: str = "copy") -> None:
        self.layout = layout
        self._tiers = list(tiers)
        # Pools that passed `KVLayout.check_pool`, while they live (`per_pool`).
        self._pools_ok: dict[int, tuple[int, Any]] = {}
        super().__init__({"store": 1, "load": 1}, name=name)

    def lane_of(self, job: Job) -> str:
        return "store" if isinstance(job.src, GPULoadStoreSpec) else "load"

    # Both lanes run at the engine's priority: loads are waited for, and stores hold the
    # engine's blocks until they are done (at a lower one, back-to-back decode steps starve them).

    def check(self, job: Job) -> None:
        eng, side, _ = engine_sides(job)
        tier = tier_of(self._tiers, side)
        pool = getattr(tier, "pool", None)
        if pool is None:
            raise ValueError(f"tier {tier.medium!r} has no pool tensor; use a DiskHandler")
        self._check_pool(tier, pool)
        check_ranges(job, tier, side, self.layout.num_blocks)
        if len(eng.block_ids) != len(side.slots) * self.layout.factor:
            raise ValueError(
                f"job {job.job_id}: {len(eng.block_ids)} engine blocks for "
                f"{len(side.slots)} slots (block_size_factor {self.layout.factor})"
            )

    def _check_pool(self, tier: Tier, pool: torch.Tensor) -> None:
        """`KVLayout.check_pool`, once per pool tensor while it lives and its memory stays
        put: a tier's pool keeps its dtype and shape (closing a tier swaps in another, empty
        tensor, which is checked afresh). A pool that fails is never kept."""
        per_pool(self._pools_ok, pool, lambda p: self.layout.check_pool(p, f"tier {tier.medium!r}"))

    def pool_fence(self, job: Job) -> Any:
        """The fence of the pool tier `job` uses: an event after that pool's own last copy
        on an asynchronous device, which the CUDA handler's stream waits on; None on the CPU
        twin (its copies are done when they return), so there is nothing to wait for."""
        _, side, _ = engine_sides(job)
        return getattr(self._tiers[side.tier], "fence", None)

    def copy(self, job: Job, *, non_blocking: bool = False, stream: Any = None) -> None:
        """The bytes of an engine <-> pool job (shared with the CUDA handler, which passes
        its lane's `stream`)."""
        eng, side, store = engine_sides(job)
        tier = self._tiers[side.tier]
        pool = tier.pool  # type: ignore[attr-defined]
        self._check_pool(tier, pool)  # e.g. closed since submission
        self.layout.pool_copy(
            eng.block_ids, pool, side.slots, store=store, non_blocking=non_blocking, stream=stream
        )
        job.size = len(side.slots) * self.layout.block_bytes

    def run(self, job: Job, lane: str) -> None:
        t0 = time.perf_counter()
        self.copy(job)
        job.time = time.perf_counter() - t0
