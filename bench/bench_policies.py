"""Micro-benchmarks of the eviction policies on 100k 16-byte keys, in 32-key chains.

Run: .venv/bin/pytest bench/bench_policies.py --benchmark-only -p no:cacheprovider

Each benchmark does 100k block-ops per round (one key passed to one call), so block-ops/s is
100_000 / median. The manager's own target is >= 1M block-ops/s for the whole call sequence, so
each policy call must cost well under a microsecond per key.
    insert       100k new keys into an empty policy
    touch        every key, as 3,125 chains of 32 (head first), on a full policy
    evict        a full policy emptied by evict(32) calls
    evict_pins   the same with the 32 coldest keys protected (blocks being loaded)
    cycle        at capacity: evict(32) + insert a new chain + touch it, 1,041 times (99,936 ops)
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from tiercache.policies import ARCPolicy, EvictionPolicy, LRUPolicy

N_KEYS = 100_000
CHAIN = 32
_rng = random.Random(0)
KEYS = [_rng.randbytes(16) for _ in range(N_KEYS)]
CHAINS = [KEYS[i : i + CHAIN] for i in range(0, N_KEYS, CHAIN)]
NEW_CHAINS = [[_rng.randbytes(16) for _ in range(CHAIN)] for _ in range(N_KEYS // (3 * CHAIN))]

policy_classes = pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy], ids=["lru", "arc"])


def full(cls: type[EvictionPolicy]) -> EvictionPolicy:
    """A policy holding all KEYS, each chain touched once (so ARC has them in T2)."""
    policy = cls(N_KEYS)
    for chain in CHAINS:
        for key in chain:
            policy.insert(key)
        policy.touch(chain)
    return policy


def run(
    benchmark: BenchmarkFixture,
    setup: Callable[[], tuple],
    work: Callable[..., None],
    rounds: int,
    block_ops: int = N_KEYS,
) -> None:
    """Time `work(*setup())` on fresh arguments each round (setup is not timed)."""
    benchmark.extra_info["block_ops"] = block_ops
    benchmark.pedantic(work, setup=lambda: (setup(), {}), rounds=rounds, iterations=1)


@policy_classes
def test_insert(benchmark: BenchmarkFixture, cls: type[EvictionPolicy]) -> None:
    def work(policy: EvictionPolicy) -> None:
        insert = policy.insert
        for key in KEYS:
            insert(key)

    run(benchmark, lambda: (cls(N_KEYS),), work, rounds=20)


@policy_classes
def test_touch(benchmark: BenchmarkFixture, cls: type[EvictionPolicy]) -> None:
    def work(policy: EvictionPolicy) -> None:
        touch = policy.touch
        for chain in CHAINS:
            touch(chain)

    policy = full(cls)  # touching only reorders, so one policy serves every round
    run(benchmark, lambda: (policy,), work, rounds=20)


@policy_classes
def test_evict(benchmark: BenchmarkFixture, cls: type[EvictionPolicy]) -> None:
    def work(policy: EvictionPolicy) -> None:
        evict = policy.evict
        while evict(CHAIN):
            pass

    run(benchmark, lambda: (full(cls),), work, rounds=10)


@policy_classes
def test_evict_pins(benchmark: BenchmarkFixture, cls: type[EvictionPolicy]) -> None:
    def setup() -> tuple[EvictionPolicy, frozenset[bytes]]:
        policy = full(cls)
        return policy, frozenset(list(policy.keys_in_eviction_order())[:CHAIN])

    def work(policy: EvictionPolicy, pinned: frozenset[bytes]) -> None:
        evict = policy.evict
        while evict(CHAIN, pinned):
            pass

    run(benchmark, setup, work, rounds=10)


@policy_classes
def test_cycle(benchmark: BenchmarkFixture, cls: type[EvictionPolicy]) -> None:
    def work(policy: EvictionPolicy) -> None:
        evict, insert, touch = policy.evict, policy.insert, policy.touch
        for chain in NEW_CHAINS:
            evict(CHAIN)
            for key in chain:
                insert(key)
            touch(chain)

    ops = len(NEW_CHAINS) * CHAIN * 3
    run(benchmark, lambda: (full(cls),), work, rounds=10, block_ops=ops)
