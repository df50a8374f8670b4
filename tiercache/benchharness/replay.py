"""Replay a trace through tiercache's manager, through vLLM's own offloading manager, and
through a whole `TierCache` with real tiers.

Primitives:
- `replay_manager(trace, policy, capacity) -> ManagerRun`: the bookkeeping call sequence a
  connector makes per request (lookup, prepare_load/complete_load of the hit prefix,
  prepare_store of the rest, touch, complete_store) on one tier of `capacity` blocks.
- `replay_vllm(trace, policy, capacity) -> ManagerRun | None`: the same requests through vLLM
  0.32's `CPUOffloadingManager` (per-key lookups, a `ReqContext` per request, request
  finalisation as its scheduler does); None when vLLM is not importable.
- `replay_cache(trace, config, block_bytes) -> CacheRun`: `get` the prefix, check each row is
  the bytes stored for its key, `put` the rest, on real tiers; per-tier hits, bytes, seconds.

A block-op is one key passed to one manager call; both managers are charged the same count
for a request (2 per key, plus 2 per hit key and 2 per stored key), so ops/s compare like for
like.

Both timed loops run under `frozen_heap()`: a full collection, then `gc.freeze()` for the
loop, as vLLM's engine freezes its heap after start-up (`vllm.utils.gc_utils.freeze_gc_heap`).
The collector stays on, so each manager pays for collecting what it allocates, but no longer for
walking the ~600k objects torch and vLLM leave on the heap: that walk took about 300 ms here,
as long as a whole replay, and landed on whichever contender happened to trigger it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tiercache.benchharness.traces import Trace
from tiercache.cache import TierCache
from tiercache.manager import OffloadingManager
from tiercache.policies import get_policy_class
from tiercache.tiers.cpu import CPUTier


@dataclass(frozen=True)
class ManagerRun:
    """One manager replay: hits are leading blocks found, ops the block-ops charged."""

    name: str
    capacity: int
    blocks: int
    hits: int
    ops: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect, then freeze what is left (leaving the collector on) until the block exits."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _ops(n_keys: int, n_hit: int) -> int:
    return 2 * n_keys + 2 * n_hit + 2 * (n_keys - n_hit)


def replay_manager(trace: Trace, policy: str, capacity: int) -> ManagerRun:
    """Drive a fresh one-tier `OffloadingManager` with `policy` over the trace."""
    tier = CPUTier(block_bytes=1, capacity_blocks=capacity, pin_memory=False)
    m = OffloadingManager([tier], [get_policy_class(policy)(capacity)])
    lookup, prep_load, done_load = m.lookup, m.prepare_load, m.complete_load
    prep_store, touch, done_store = m.prepare_store, m.touch, m.complete_store
    hits = ops = 0
    with frozen_heap():
        t0 = time.perf_counter()
        for keys in trace.requests:
            n = lookup(keys) or 0
            if n:
                head = keys[:n]
                prep_load(head)
                done_load(head)
            out = prep_store(keys[n:]) if n < len(keys) else None
            touch(keys)
            if out is not None:
                done_store(out.keys_to_store)
            hits += n
            ops += _ops(len(keys), n)
        secs = time.perf_counter() - t0
    return ManagerRun(f"tiercache {policy}", capacity, trace.n_blocks, hits, ops, secs)


def vllm_available() -> bool:
    """True when vLLM's CPU offloading manager can be imported here."""
    try:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: F401
    except Exception:  # vLLM missing, or present but broken on this machine
        return False
    return True


def replay_vllm(trace: Trace, policy: str, capacity: int) -> ManagerRun | None:
    """Drive vLLM's `CPUOffloadingManager(num_chunks=capacity, cache_policy=policy)` over the
    trace the way its 0.32 scheduler does; None when vLLM is not importable."""
    if not vllm_available():
        return None
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(num_chunks=capacity, cache_policy=policy)
    hit = LookupResult.HIT
    # vLLM keys carry a 4-byte KV-group index; convert outside the timed loop.
    reqs = [[make_offload_key(k, 0) for k in r] for r in trace.requests]
    hits = ops = 0
    with frozen_heap():
        t0 = time.perf_counter()
        for i, keys in enumerate(reqs):
            ctx = ReqContext(req_id=str(i))
            m.on_new_request(ctx)
            n = 0
            for k in keys:
                if m.lookup(k, ctx) is not hit:
                    break
                n += 1
            if n:
                head = keys[:n]
                m.prepare_load(head, ctx)
                m.complete_load(head, ctx)
            if n < len(keys):
                out = m.prepare_store(keys[n:], ctx)
                if out is not None and out.keys_to_store:
                    m.complete_store(out.keys_to_store, ctx)
            m.on_request_finished(ctx)
            hits += n
            ops += _ops(len(keys), n)
        secs = time.perf_counter() - t0
    return ManagerRun(f"vllm {policy}", capacity, trace.n_blocks, hits, ops, secs)


# -- whole-cache replay ----------------------------------------------------------------------
@dataclass
class TierIO:
    """Bytes and seconds one tier spent in read/write during a replay."""

    medium: str
    kind: str
    capacity_blocks: int
    read_bytes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        """Blocks served by this tier over the blocks that reached it (its hits + misses)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class CacheRun:
    """One TierCache replay: overall hits, wall time, per-tier IO and counters."""

    trace: str
    blocks: int
    hits: int
    seconds: float
    block_bytes: int
    tiers: list[TierIO] = field(default_factory=list)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    @property
    def blocks_per_s(self) -> float:
        return self.blocks / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_moved(self) -> int:
        return sum(t.read_bytes + t.write_bytes for t in self.tiers)


def _count_io(tier: Any, io: TierIO) -> None:
    """Wrap one tier's read/write (on the instance) to count bytes and time."""
    read, write, bb = tier.read, tier.write, tier.block_bytes

    def counted_read(slots: Sequence[int], dst: torch.Tensor, keys: Any = None) -> list[int]:
        t0 = time.perf_counter()
        try:
            return read(slots, dst, keys)
        finally:
            io.read_s += time.perf_counter() - t0
            io.read_bytes += len(slots) * bb

    def counted_write(slots: Sequence[int], src: torch.Tensor, keys: Any = None) -> None:
        t0 = time.perf_counter()
        try:
            write(slots, src, keys)
        finally:
            io.write_s += time.perf_counter() - t0
            io.write_bytes += len(slots) * bb

    tier.read, tier.write = counted_read, counted_write


def stand_in_blocks(keys: Sequence[bytes], block_bytes: int) -> torch.Tensor:
    """uint8 `[len(keys), block_bytes]`, each row its key repeated: checkable stand-in KV."""
    reps = -(-block_bytes // 16)
    data = b"".join((k * reps)[:block_bytes] for k in keys)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(keys), block_bytes)


def replay_cache(
    trace: Trace,
    config: Mapping[str, Any],
    block_bytes: int,
    *,
    progress: Callable[[int], None] | None = None,
) -> CacheRun:
    """Replay through a fresh `TierCache.open(config)`: get the prefix (each row checked
    against its key), put the rest. Raises AssertionError if a wrong byte is ever served."""
    cache = TierCache.open(dict(config), block_bytes=block_bytes)
    ios = [TierIO(t.medium, t.kind, t.capacity_blocks) for t in cache.tiers]
    for t, io in zip(cache.tiers, ios, strict=True):
        _count_io(t, io)
    longest = max(len(r) for r in trace.requests)
    buf = torch.empty((longest, block_bytes), dtype=torch.uint8)
    hits = 0
    try:
        t0 = time.perf_counter()
        for i, keys in enumerate(trace.requests):
            got = cache.get(keys, out=buf[: len(keys)])
            n = len(got)
            if n:
                heads = got[:, :16].numpy().tobytes()
                if heads != b"".join(keys[:n]):
                    raise AssertionError(f"request {i}: a served block holds another key's bytes")
            if n < len(keys):
                rest = keys[n:]
                cache.put(rest, stand_in_blocks(rest, block_bytes))
            hits += n
            if progress is not None and i % 64 == 0:
                progress(i)
        secs = time.perf_counter() - t0
        stats = cache.stats()
        ios = [replace(io) for io in ios]  # as of now: close() writes back more
    finally:
        cache.close()
    for io in ios:
        io.hits = stats[io.medium]["hits"]
        io.misses = stats[io.medium]["misses"]
    return CacheRun(trace.name, trace.n_blocks, hits, secs, block_bytes, ios, stats)
