"""A block another process evicted from a shared store is a plain miss on every path that
reads it: dropped from the index, no error counted, the tier never suspended. The rule has
one home, `Tier.sort_failed`; here the facade's paths (`get`, `fetch`, a chain served partly
from a tier above) and the transfer engine's disk handler, on a real LMDB environment opened
twice: the second instance opens after the first stored (the unlucky order: it finds the
blocks at open and indexes them), then the first instance's stores evict them. The adapters'
paths are in tests/vllm/test_evicted_elsewhere.py."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.campaign_support import blocks, key, key_id, load_on_this_thread
from tiercache import TierCache

BB, CAP = 4096, 8


def _config(path: Path, *, cpu: int = 0) -> dict:
    tiers = [{"kind": "cpu", "blocks": cpu}] if cpu else []
    tiers.append({"kind": "lmdb", "path": str(path), "blocks": CAP})
    return {"block_size": 4, "namespace": "gone", "tiers": tiers}


def _unlucky(path: Path, *, cpu: int = 0) -> tuple[TierCache, TierCache]:
    """A stores blocks 0..7 (the store's whole capacity); B opens after, so it holds them in
    its index; then A stores 8..15 and the store evicts 0..7 (its capacity is shared)."""
    a = TierCache.open(_config(path), block_bytes=BB)
    a.put([key(i) for i in range(CAP)], blocks(range(CAP), BB))
    b = TierCache.open(_config(path, cpu=cpu), block_bytes=BB)
    assert b.lookup([key(i) for i in range(CAP)], count=False) == CAP
    a.put([key(i) for i in range(CAP, 2 * CAP)], blocks(range(CAP, 2 * CAP), BB))
    return a, b


def _healthy(cache: TierCache, medium: str = "lmdb") -> None:
    """No error counted, the tier never suspended (its circuit breaker closed)."""
    st = cache.stats()[medium]
    assert st["errors"] == 0, st
    assert st["suspensions"] == 0 and st["suspended_ms"] == 0, st
    assert cache.manager.suspended() == [0.0] * len(cache.tiers)


def test_get_and_fetch_of_a_block_evicted_elsewhere_are_plain_misses(tmp_path: Path) -> None:
    a, b = _unlucky(tmp_path / "env")
    try:
        gone = [key(i) for i in range(4)]
        # 1. get: the chain ends before the first evicted block; nothing is an error.
        assert len(b.get(gone)) == 0
        _healthy(b)
        assert b.lookup(gone, count=False) == 0  # dropped from the index
        # 2. fetch (what the in-process KV connector's verifying read calls): the same.
        assert b.fetch([key(i) for i in range(4, CAP)], count=False) == 0
        _healthy(b)
        # 3. What A stored since is served to B (discovered), exact.
        fresh = [key(i) for i in range(CAP, 2 * CAP)]
        assert torch.equal(b.get(fresh), blocks(range(CAP, 2 * CAP), BB))
        _healthy(b)
    finally:
        b.close()
        a.close()


def test_a_chain_held_above_and_gone_below_is_served_up_to_the_gone_block(
    tmp_path: Path,
) -> None:
    """B has a CPU tier over LMDB and holds the chain's head there: the head is served,
    the chain ends at the block A's stores evicted from LMDB, and nothing is an error."""
    a, b = _unlucky(tmp_path / "env", cpu=4)
    try:
        head = [key(100), key(101)]
        b.put(head, blocks([100, 101], BB))  # into B's CPU tier
        got = b.get([*head, key(0), key(1)])
        assert torch.equal(got, blocks([100, 101], BB))
        _healthy(b)
        _healthy(b, "cpu")
    finally:
        b.close()
        a.close()


def test_the_disk_handler_reports_a_block_evicted_elsewhere_as_gone(tmp_path: Path) -> None:
    """The transfer engine (the KV connector's and the OffloadingSpec's worker) reads on its
    own threads: it sorts the failures there and reports the gone ones apart."""
    a, b = _unlucky(tmp_path / "env", cpu=4)
    try:
        keys = (key(0), key(CAP), key(1))  # gone, held, gone
        with b.lock:
            assert b.manager.lookup(keys[1:2], count=False) == 1  # discovered: A stored it
            spec = b.manager.prepare_load(keys)  # all three in LMDB, as B's index says
        assert spec.tiers == (1, 1, 1)
        cpu = b.tiers[0]
        r = load_on_this_thread(b, 1, spec.slots, keys, (0, 1, 2))
        assert not r.success and r.failed == (0, 2) and r.gone == (0, 2)
        assert torch.equal(cpu.pool[1], blocks([CAP], BB)[0])  # the held one arrived
    finally:
        b.close()
        a.close()


def test_another_process_evictions_leave_the_index_and_a_put_stores_them_again(
    tmp_path: Path,
) -> None:
    """B's index held 0..7 (found at open) when A's stores evicted them. B learns it from the
    store's removal log: its next put stores them again instead of acknowledging them from
    its stale index (a fresh process reads them back exact), and its events report all eight
    removed, then the three it stored again: a router replaying them holds B to those three."""
    a, b = _unlucky(tmp_path / "env")
    try:
        again = [key(i) for i in range(3)]
        assert b.put(again, blocks(range(3), BB)) == 3
        with TierCache.open(_config(tmp_path / "env"), block_bytes=BB) as c:
            assert torch.equal(c.get(again), blocks(range(3), BB))
        view: set[int] = set()  # what a router replaying B's events believes B holds
        removed = set()
        for e in b.take_events():  # the blocks found at open, then the removals, the put
            ids = {key_id(k) for k in e.keys}
            view = view - ids if e.removed else view | ids
            removed |= ids if e.removed else set()
        assert removed == set(range(CAP)) and view == {0, 1, 2}
        assert b.lookup([key(i) for i in range(3, CAP)], count=False) == 0
        assert b.lookup(again, count=False) == 3
        _healthy(b)
    finally:
        b.close()
        a.close()
