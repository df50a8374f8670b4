"""`TierCache.fetch`: a hit's blocks read, verified and promoted into the first tier without
handing bytes back (what the in-process connector does before it reports a hit). Real NVMe
files under a CPU tier, real tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_cache_seams import Boom, _raise_in, assert_consistent
from tests.test_tier_nvme import flip, slot_of
from tiercache import TierCache
from tiercache.tiers import format as fmt
from tiercache.workload import block_bytes_for

N = 4096  # a block: one page, so a slot holds it beside its header at O_DIRECT alignment


def open_cache(tmp_path: Path, first: int = 4, promote: bool = True) -> TierCache:
    nvme = {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 32}
    tiers = [{"kind": "cpu", "blocks": first}, {**nvme, "write_policy": "write-back"}]
    config = {"block_size": 4, "namespace": "fetch/bf16/tp1/0", "tiers": tiers, "promote": promote}
    return TierCache.open(config, block_bytes=N)


def demoted(cache: TierCache) -> tuple[list[bytes], list[bytes], torch.Tensor]:
    """Two 4-block chains put in turn: `a` demoted into NVMe, `b` in the CPU tier."""
    a = cache.hash_tokens(list(range(16)))
    b = cache.hash_tokens(list(range(100, 116)))
    blocks = block_bytes_for(a + b, N)
    cache.put(a, blocks[:4])
    cache.put(b, blocks[4:])
    assert [cache.manager.where(k) for k in a] == [[1]] * 4
    return a, b, blocks


def test_fetch_reads_verified_blocks_straight_into_the_first_tier(tmp_path: Path) -> None:
    with open_cache(tmp_path) as cache:
        a, b, blocks = demoted(cache)
        pool = cache.tiers[0].pool
        lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel()
        seen: list[int] = []
        real = cache.tiers[1].read

        def spy(slots, dst, keys=None):
            seen.append(dst.data_ptr())
            return real(slots, dst, keys)

        cache.tiers[1].read = spy  # type: ignore[method-assign]
        assert cache.fetch(a) == 4
        # One read, into the CPU tier's own rows: no result buffer, no second copy.
        assert len(seen) == 1 and lo <= seen[0] < hi
        assert all(cache.manager.where(k)[0] == 0 for k in a)
        cache.tiers[1].read = real  # type: ignore[method-assign]
        assert torch.equal(cache.get(a), blocks[:4])  # from the CPU tier now
        assert cache.stats()["cpu"]["used_blocks"] == cache.stats()["cpu"]["ready_blocks"] == 4
        assert_consistent(cache, a + b, blocks)


def test_fetch_counts_a_request_once(tmp_path: Path) -> None:
    with open_cache(tmp_path) as cache:
        a, _, _ = demoted(cache)
        before = cache.stats()["cpu"]
        assert cache.lookup(a) == 4
        assert cache.fetch(a) == 4  # the lookup counted these blocks already
        assert cache.fetch(a, count=False) == 4
        after = cache.stats()["cpu"]
        assert after["hits"] + after["misses"] == before["hits"] + before["misses"] + 4


def test_fetch_stops_at_a_corrupt_block_and_frees_its_reserved_slot(tmp_path: Path) -> None:
    with open_cache(tmp_path) as cache:
        a, b, blocks = demoted(cache)
        cache.tiers[1].flush()
        store = tmp_path / "nvme"
        sb = json.loads((store / "meta.json").read_text())["slot_bytes"]
        flip(store / "slab", slot_of(store, a[2]) * sb + fmt.HEADER_SIZE + 5)
        errors = cache.stats()["nvme"]["errors"]
        assert cache.fetch(a) == 2
        assert cache.stats()["nvme"]["errors"] == errors + 1
        m = cache.manager
        assert m.where(a[2]) == [] and not m.is_pending(a[2])  # dropped, not half-promoted
        assert all(m.where(k)[0] == 0 for k in a[:2] + a[3:])  # good bytes are promoted
        stats = cache.stats()
        assert stats["cpu"]["used_blocks"] == stats["cpu"]["ready_blocks"]
        assert torch.equal(cache.get(a[:2]), blocks[:2])
        assert_consistent(cache, a + b, blocks)


def test_fetch_without_promotion_still_verifies(tmp_path: Path) -> None:
    with open_cache(tmp_path, promote=False) as cache:
        a, b, _ = demoted(cache)
        cache.tiers[1].flush()
        store = tmp_path / "nvme"
        sb = json.loads((store / "meta.json").read_text())["slot_bytes"]
        flip(store / "slab", slot_of(store, a[1]) * sb + fmt.HEADER_SIZE + 5)
        assert cache.fetch(a) == 1
        assert [cache.manager.where(k) for k in a] == [[1], [], [1], [1]]
        assert cache.fetch(b) == 4  # in the CPU tier: nothing to read


@pytest.mark.parametrize("where", ["read", "write"])
def test_fetch_rolls_back_on_any_exception(tmp_path: Path, where: str) -> None:
    """A bug raised while reading (or, through staging, promoting) leaves no slot reserved,
    no key pinned or moving, and the blocks store and load again exactly."""
    with open_cache(tmp_path) as cache:
        a, b, blocks = demoted(cache)
        if where == "write":
            # b[1] and b[3] used last: a[:2]'s promotion evicts b[0] and b[2], and their
            # slots are no run, so the blocks go through staging and the first tier's write.
            cache.get(b[1:2])
            cache.get(b[3:4])
        with pytest.MonkeyPatch.context() as mp:
            _raise_in(mp, cache.tiers[1 if where == "read" else 0], where)
            with pytest.raises(Boom):
                cache.fetch(a[:2])
        assert_consistent(cache, a + b, blocks)


def test_fetch_verifies_a_persistent_first_tier(tmp_path: Path) -> None:
    """With NVMe as the only tier, the blocks are in "the first tier" but on disk: read and
    checked all the same (the connector's hung-read test first caught this)."""
    config = {
        "block_size": 4,
        "namespace": "fetch/bf16/tp1/0",
        "tiers": [{"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 8}],
    }
    with TierCache.open(config, block_bytes=N) as cache:
        a = cache.hash_tokens(list(range(16)))
        cache.put(a, block_bytes_for(a, N))
        cache.tiers[0].flush()
        store = tmp_path / "nvme"
        sb = json.loads((store / "meta.json").read_text())["slot_bytes"]
        flip(store / "slab", slot_of(store, a[3]) * sb + fmt.HEADER_SIZE + 5)
        assert cache.fetch(a) == 3
        assert cache.manager.where(a[3]) == []
