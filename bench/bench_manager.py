"""Manager block-ops/s on a seeded trace, LRU and ARC, against a same-run baseline.

Trace: 20k requests of 16-64 blocks whose heads share Zipf-popular prefixes; one tier of
100k blocks; the real call sequence per request:
lookup -> prepare_load/complete_load (hits) -> prepare_store (misses) -> touch -> complete_store.
A block-op is one key passed to one call. The baseline runs the same sequence on the
simplest possible bookkeeping (one OrderedDict: no states, pins, events or stats), so the
ratio says what the manager's guarantees cost. When vLLM is importable its own
CPUOffloadingManager runs the same trace too.

Run: python bench/bench_manager.py [--requests 20000] [--capacity 100000] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import OrderedDict

import numpy as np

from tiercache.benchharness.replay import frozen_heap
from tiercache.manager import OffloadingManager
from tiercache.policies import ARCPolicy, LRUPolicy
from tiercache.tiers.cpu import CPUTier


def make_trace(
    n_requests: int = 20_000, *, seed: int = 0, n_prefixes: int = 2_000, zipf_a: float = 1.1
) -> list[list[bytes]]:
    """Chains of 16-64 keys; each starts with part of a Zipf-chosen shared prefix."""
    rng = np.random.default_rng(seed)
    prefix_len = rng.integers(8, 48, size=n_prefixes)
    prefixes = [[rng.bytes(16) for _ in range(int(n))] for n in prefix_len]
    p = np.arange(1, n_prefixes + 1, dtype=np.float64) ** -zipf_a
    p /= p.sum()
    choice = rng.choice(n_prefixes, size=n_requests, p=p)
    lengths = rng.integers(16, 65, size=n_requests)
    trace = []
    for c, n in zip(choice, lengths, strict=True):
        pre = prefixes[int(c)]
        shared = min(len(pre), int(rng.integers(len(pre) // 2, len(pre) + 1)), int(n))
        trace.append(pre[:shared] + [rng.bytes(16) for _ in range(int(n) - shared)])
    return trace


def run_manager(trace: list[list[bytes]], policy: type, capacity: int) -> tuple[float, int, int]:
    """(seconds, block-ops, hit blocks) for the real call sequence on a fresh manager."""
    tier = CPUTier(block_bytes=1, capacity_blocks=capacity)
    m = OffloadingManager([tier], [policy(capacity)])
    ops = hits = 0
    t0 = time.perf_counter()
    for keys in trace:
        n = m.lookup(keys) or 0
        if n:
            head = keys[:n]
            m.prepare_load(head)
            m.complete_load(head)
        out = m.prepare_store(keys[n:]) if n < len(keys) else None
        m.touch(keys)
        if out is not None:
            m.complete_store(out.keys_to_store)
        ops += 2 * len(keys) + 2 * n + 2 * (len(keys) - n)
        hits += n
    return time.perf_counter() - t0, ops, hits


def run_baseline(trace: list[list[bytes]], capacity: int) -> tuple[float, int, int]:
    """The same sequence on one OrderedDict (LRU, no states/pins/events): the floor."""
    od: OrderedDict[bytes, bool] = OrderedDict()
    ops = hits = 0
    t0 = time.perf_counter()
    for keys in trace:
        n = 0
        for k in keys:
            if k not in od:
                break
            n += 1
        head = keys[:n]
        for _ in range(2):  # prepare_load + complete_load: one dict access per key each
            for k in head:
                od[k] = True
        new = [k for k in keys[n:] if k not in od]
        over = len(od) + len(new) - capacity
        for _ in range(max(over, 0)):
            od.popitem(last=False)
        for k in reversed(keys):
            if k in od:
                od.move_to_end(k)
        for k in new:
            od[k] = True
        ops += 2 * len(keys) + 2 * n + 2 * (len(keys) - n)
        hits += n
    return time.perf_counter() - t0, ops, hits


def run_vllm(trace: list[list[bytes]], policy: str, capacity: int) -> tuple[float, int, int] | None:
    """vLLM's own CPUOffloadingManager on the same trace, driven as its 0.32 scheduler drives
    it (the harness's `replay_vllm`, one implementation for both), when vLLM is importable."""
    from tiercache.benchharness.replay import replay_vllm
    from tiercache.benchharness.traces import Trace

    t = Trace("bench_manager", tuple(map(tuple, trace)), tuple(range(len(trace))))
    run = replay_vllm(t, policy, capacity)
    return None if run is None else (run.seconds, run.ops, run.hits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--capacity", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    trace = make_trace(args.requests, seed=args.seed)
    blocks = sum(map(len, trace))
    print(
        f"# trace: {len(trace)} requests, {blocks} blocks, capacity {args.capacity}, "
        f"median of {args.runs} runs"
    )
    runners = {
        "baseline(OrderedDict)": lambda: run_baseline(trace, args.capacity),
        "tiercache lru": lambda: run_manager(trace, LRUPolicy, args.capacity),
        "tiercache arc": lambda: run_manager(trace, ARCPolicy, args.capacity),
        "vllm lru": lambda: run_vllm(trace, "lru", args.capacity),
        "vllm arc": lambda: run_vllm(trace, "arc", args.capacity),
    }
    results: dict[str, float] = {}
    for name, fn in runners.items():
        rates, hit_rate = [], 0.0
        for _ in range(args.runs):
            with frozen_heap():  # as the harness does: no full-GC walk lands on one contender
                r = fn()
            if r is None:
                break
            secs, ops, hits = r
            rates.append(ops / secs)
            hit_rate = hits / blocks
        if not rates:
            print(f"{name:24s} skipped (not importable)")
            continue
        results[name] = statistics.median(rates)
        print(
            f"{name:24s} {results[name]:>12,.0f} block-ops/s  (min {min(rates):,.0f}, "
            f"max {max(rates):,.0f})  hit rate {hit_rate:.3f}"
        )
    base = results["baseline(OrderedDict)"]
    for name, rate in results.items():
        print(f"RATIO {name} / baseline = {rate / base:.2f}")


if __name__ == "__main__":
    main()
