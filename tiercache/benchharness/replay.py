"""Replay a trace through tiercache's manager, through vLLM's own offloading manager, and
through a whole `TierCache` with real tiers.

Primitives:
- `replay_manager(trace, policy, capacity) -> ManagerRun`: per request, the calls a connector
  makes on tiercache's manager, in vLLM's scheduler order (lookup; touch of what is held, so
  the hits count as used before the store makes room; prepare_load/complete_load of the hit
  prefix; prepare_store/complete_store of the rest) on one tier of `capacity` blocks. A
  block is never touched after its own store: a store is not a use.
- `replay_vllm(trace, policy, capacity) -> ManagerRun | None`: the same requests through vLLM
  0.32's `CPUOffloadingManager`, called exactly as its OffloadingConnector scheduler calls it
  for a request served alone (`VLLM_SCHEDULER_CALLS`; `tests/vllm/test_bench_agreement.py`
  records a real scheduler and compares); None when vLLM is not importable.
- `replay_cache(trace, config, block_bytes) -> CacheRun`: `get` the prefix (a use: it touches
  what it returns), check each row is the bytes stored for its key, `put` the rest (touches
  only what was already held, then stores), on real tiers; per-tier hits, bytes, seconds.

Both managers are charged the same block-ops per request (`_ops`), and both timed loops run
under `frozen_heap()`, as vLLM's engine freezes its heap after start-up (docs/bench.md).
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
from tiercache.workload import block_bytes_for


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
    """Drive a fresh one-tier `OffloadingManager` with `policy` over the trace, one request
    at a time, as a connector drives it in vLLM's scheduler order (see the module doc)."""
    tier = CPUTier(block_bytes=1, capacity_blocks=capacity, pin_memory=False)
    m = OffloadingManager([tier], [get_policy_class(policy)(capacity)])
    lookup, prep_load, done_load = m.lookup, m.prepare_load, m.complete_load
    prep_store, touch, done_store = m.prepare_store, m.touch, m.complete_store
    hits = ops = 0
    with frozen_heap():
        t0 = time.perf_counter()
        for keys in trace.requests:
            n = lookup(keys) or 0
            touch(keys)  # what is held, before the store makes room (see the module doc)
            if n:
                head = keys[:n]
                prep_load(head)
                done_load(head)
            if n < len(keys):
                out = prep_store(keys[n:])
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


# What vLLM 0.32's OffloadingConnector scheduler (vllm/distributed/kv_transfer/kv_connector/
# v1/offloading/scheduler.py) calls on its manager for one request served alone, in this order
# (docs/bench.md, "Manager throughput"): lookup key by key up to the first miss, prepare_load
# and complete_load of the hit prefix, prepare_store of the rest, complete_store after the
# request finished. It never calls `touch`; a refused prepare_store's retry changes no state
# and is not replayed; per-step hooks and metrics are no-ops in CPUOffloadingManager.
VLLM_SCHEDULER_CALLS = (
    "on_new_request",
    "lookup",
    "prepare_load",
    "complete_load",
    "prepare_store",
    "on_request_finished",
    "complete_store",
)


def vllm_request_contexts(trace: Trace) -> list[tuple[list[bytes], Any]]:
    """Per request: vLLM offload keys (group 0) and the `ReqContext` its scheduler builds,
    with each key's end-token position (`update_offload_keys`), which the manager reads to
    order the request's keys when it finishes. Scheduler work, so built outside the timing."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    out = []
    bs = trace.block_size
    for i, r in enumerate(trace.requests):
        keys = [make_offload_key(k, 0) for k in r]
        ctx = ReqContext(req_id=str(i))
        for j, k in enumerate(keys, 1):
            ctx.set_offload_key_position(k, j * bs)
        out.append((keys, ctx))
    return out


def replay_vllm(trace: Trace, policy: str, capacity: int) -> ManagerRun | None:
    """Drive vLLM's `CPUOffloadingManager(num_chunks=capacity, cache_policy=policy)` over the
    trace, one request at a time, with the calls `VLLM_SCHEDULER_CALLS` lists, in its order;
    None when vLLM is not importable."""
    if not vllm_available():
        return None
    from vllm.v1.kv_offload.base import LookupResult
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(num_chunks=capacity, cache_policy=policy)
    hit = LookupResult.HIT
    reqs = vllm_request_contexts(trace)
    hits = ops = 0
    with frozen_heap():
        t0 = time.perf_counter()
        for keys, ctx in reqs:
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
            out = m.prepare_store(keys[n:], ctx) if n < len(keys) else None
            m.on_request_finished(ctx)
            if out is not None and out.keys_to_store:
                m.complete_store(out.keys_to_store, ctx)
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

    def tier_hit_rate(self, medium: str) -> float:
        """Blocks served by one tier over the blocks that reached it (its hits + misses)."""
        counts = self.stats[medium]
        reached = counts["hits"] + counts["misses"]
        return counts["hits"] / reached if reached else 0.0

    @property
    def bytes_moved(self) -> int:
        return sum(t.read_bytes + t.write_bytes for t in self.tiers)


def _count_io(tier: Any, io: TierIO) -> None:
    """Wrap one tier's read and write (on the instance) to count their bytes and time."""
    bb = tier.block_bytes

    def counted(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(slots: Sequence[int], buf: torch.Tensor, keys: Any = None) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(slots, buf, keys)
            finally:
                setattr(io, f"{op}_s", getattr(io, f"{op}_s") + time.perf_counter() - t0)
                setattr(io, f"{op}_bytes", getattr(io, f"{op}_bytes") + len(slots) * bb)

        return call

    tier.read, tier.write = counted("read", tier.read), counted("write", tier.write)


stand_in_blocks = block_bytes_for  # checkable stand-in KV: each row its key repeated


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
        # Drain the write-through copier: a copy it has written but not yet completed would
        # count bytes at the tier and no store in the stats (part of the replay's work).
        cache.flush()
        secs = time.perf_counter() - t0
        stats = cache.stats()
        ios = [replace(io) for io in ios]  # as of now: close() writes back more
    finally:
        cache.close()
    return CacheRun(trace.name, trace.n_blocks, hits, secs, block_bytes, ios, stats)
