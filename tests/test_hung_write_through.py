"""A write-through copy stuck on a hung lower tier pins its source block, and what that costs
(issue 47, "a hung Redis still costs a fresh block now and then").

The set-up the issue saw it in: a CPU tier of 8 blocks (LRU) over Redis, written through (the
default below a volatile tier), Redis SIGSTOPped; each round reads the two newest chains of 4
blocks and puts a new one. Now and then the older chain read back 3 of its 4 blocks. The
cause is capacity, not a lost block: the write-through copier's copy into the hung tier pins
its source (a CPU block of the oldest chain) until the write returns, so the put's eviction
passes over it and takes the next least recently used block, the tail of a chain read since.
Its demotion into the hung tier fails, so it is dropped: a miss, counted (`evictions`,
`dropped`). At most max(1, first tier blocks // THROUGH_PIN_SHARE) copies are pinned at once,
so a store evicts at most that many blocks out of the policy's order (docs/operations.md,
"Failure modes"). Here the lower tier is LMDB whose writes hang, then fail, on an event (a
Redis read that times out), so the scenario is exact, not timed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from tests.test_moving_reads import FailWrites
from tiercache import TierCache
from tiercache.write_through import THROUGH_PIN_SHARE

BB = 4096
CPU_BLOCKS = 8


def _open(tmp_path: Path) -> TierCache:
    """CPU (8 blocks, LRU) over LMDB written through, 4-token blocks, no promotion."""
    cfg = {
        "block_size": 4,
        "promote": False,
        "tiers": [
            {"kind": "cpu", "blocks": CPU_BLOCKS, "policy": "lru"},
            {
                "kind": "lmdb",
                "path": str(tmp_path / "lmdb"),
                "blocks": 64,
                "write_policy": "write-through",
            },
        ],
    }
    return TierCache.open(cfg, block_bytes=BB)


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BB), dtype=torch.uint8, generator=g)


def _chains(cache: TierCache) -> list[list[bytes]]:
    """Chains A, B, C of 4 blocks each."""
    return [cache.hash_tokens(list(range(100 * i, 100 * i + 16))) for i in range(3)]


def test_a_stuck_write_through_copy_costs_one_recently_used_block(
    tmp_path: Path,
) -> None:
    pinned = max(1, CPU_BLOCKS // THROUGH_PIN_SHARE)  # write-through copies in flight, at most
    assert pinned == 1
    cache = _open(tmp_path)
    m = cache.manager
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(cache.put(c, _rows(4, 3))))
    try:
        a, b, c = _chains(cache)
        fail = FailWrites(cache.tiers[1])  # the lower tier hangs, then gives up
        assert cache.put(a, _rows(4, 1)) == 4
        assert fail.entered.wait(10)  # the copier's first copy (A's head) hangs, pinned
        assert cache.put(b, _rows(4, 2)) == 4  # the CPU tier is full: A and B
        assert cache.get(a).shape[0] == 4 and cache.get(b).shape[0] == 4  # A, then B, used
        assert cache.stats()["cpu"]["pinned_blocks"] == pinned
        # C needs 4 slots. The LRU order offers A's 4 blocks (a chain's tail first), but
        # the pinned head stays, so the policy's fourth victim is B's tail. Their demotions
        # into the lower tier hang (the put runs them without the cache's lock).
        t.start()
        end = time.monotonic() + 10
        while not m.is_moving(b[3]):  # C's plan is made: B's tail is on its way down
            assert time.monotonic() < end and t.is_alive(), "C's put planned no demotion of B"
            time.sleep(0.005)
        assert m.where(a[0]) == [0] and not any(m.is_moving(k) for k in (a[0], *b[:3]))
        fail.release.set()  # every write into the lower tier fails now
        t.join(10)
        assert out == [4]
        cache.flush()
        # B lost exactly `pinned` blocks, its tail: a miss, never wrong bytes.
        assert cache.lookup(b) == 4 - pinned
        assert torch.equal(cache.get(b), _rows(4, 2)[: 4 - pinned])
        assert cache.lookup(c) == 4 and torch.equal(cache.get(c), _rows(4, 3))
        # What stayed of A is the head its stuck copy pinned, whole.
        assert [m.where(k) for k in a] == [[0]] * pinned + [[]] * (4 - pinned)
        assert torch.equal(cache.get(a), _rows(4, 1)[:pinned])
        st = cache.stats()
        # C's four victims were demoted (planned into the lower tier) and failed there.
        assert st["cpu"]["evictions"] == 4 and st["lmdb"]["demoted_in"] == 4, st
        assert st["lmdb"]["errors"] > 0 and st["lmdb"]["used_blocks"] == 0, st
    finally:
        fail.release.set()
        if t.is_alive():
            t.join(10)
        cache.close()


def test_without_a_stuck_copy_the_eviction_follows_the_policy(tmp_path: Path) -> None:
    """The same rounds with a lower tier that works and every copy done before C's put:
    nothing is pinned, C's eviction takes A's four blocks (held below already: dropped from
    the CPU tier only), and B stays whole in the CPU tier."""
    cache = _open(tmp_path)
    m = cache.manager
    try:
        a, b, c = _chains(cache)
        assert cache.put(a, _rows(4, 1)) == 4 and cache.put(b, _rows(4, 2)) == 4
        cache.flush()  # every write-through copy has run: nothing pinned
        assert cache.get(a).shape[0] == 4 and cache.get(b).shape[0] == 4
        assert cache.stats()["cpu"]["pinned_blocks"] == 0
        assert cache.put(c, _rows(4, 3)) == 4
        assert [m.where(k) for k in b] == [[0, 1]] * 4
        assert [m.where(k) for k in a] == [[1]] * 4  # the copies below serve A
        assert torch.equal(cache.get(a), _rows(4, 1))
    finally:
        cache.close()
