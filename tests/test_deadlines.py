"""Deadlines (issue 16, item 1): the circuit breaker, the manager skipping suspended tiers,
and loads into the engine that are abandoned at their deadline without writing engine blocks
later. Real NVMe and LMDB tiers with files; a read that blocks stands in for a hung disk."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.test_transfer_common import K, make_kv, new_threads
from tiercache.breaker import CircuitBreaker
from tiercache.config import CacheConfig, DeadlineConfig
from tiercache.errors import ConfigError
from tiercache.manager import OffloadingManager
from tiercache.policies import LRUPolicy
from tiercache.tiers.cpu import CPUTier
from tiercache.tiers.lmdb import LMDBTier
from tiercache.tiers.nvme import NVMeTier
from tiercache.transfer import GPULoadStoreSpec, KVLayout, TierLoadStoreSpec, build_worker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# -- the breaker ------------------------------------------------------------------------------
def test_breaker_opens_doubles_caps_and_closes_by_itself() -> None:
    clock = Clock()
    b = CircuitBreaker(3, backoff=1.0, backoff_max=3.0, clock=clock)
    assert b.mask() == 0
    assert b.trip(1) == 1.0
    assert b.mask() == 0b010 and b.remaining()[1] == 1.0
    assert b.trip(1) == 1.0  # still open: one hang seen by many jobs extends nothing
    assert b.trips == [0, 1, 0]
    clock.t += 1.0
    assert b.mask() == 0  # closed again by itself (half-open: the next miss doubles)
    assert b.trip(1) == 2.0
    clock.t += 2.0
    assert b.trip(1) == 3.0  # capped at backoff_max
    clock.t += 3.0
    b.succeeded(1)  # a load in time: the next trip starts short again
    assert b.trip(1) == 1.0 and b.trips == [0, 4, 0]
    b.trip(2)
    assert b.mask() == 0b110


def test_breaker_and_deadline_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="backoff"):
        CircuitBreaker(2, backoff=5.0, backoff_max=1.0)
    cfg = CacheConfig.from_mapping(
        {"tiers": [{"kind": "cpu", "blocks": 4}], "deadlines": {"load_timeout": 0.25}}
    )
    assert cfg.deadlines == DeadlineConfig(load_timeout=0.25)
    assert CacheConfig.from_mapping({"tiers": [{"kind": "cpu", "blocks": 4}]}).deadlines == (
        DeadlineConfig()
    )
    for bad, field in [
        ({"load_timeout": 0}, "deadlines.load_timeout"),
        ({"load_timeout": True}, "deadlines.load_timeout"),
        ({"backoff": 9, "backoff_max": 2}, "deadlines.backoff"),
        ({"timeout": 1}, "deadlines.timeout"),
    ]:
        with pytest.raises(ConfigError, match=field):
            CacheConfig.from_mapping({"tiers": [{"kind": "cpu", "blocks": 4}], "deadlines": bad})


# -- the manager skips suspended tiers ----------------------------------------------------------
def _manager(tmp_path: Path, clock: Clock) -> OffloadingManager:
    tiers = [
        CPUTier(block_bytes=64, capacity_blocks=2),
        NVMeTier(path=str(tmp_path / "nvme"), block_bytes=64, capacity_blocks=16, fsync="never"),
    ]
    breaker = CircuitBreaker(2, backoff=1.0, backoff_max=8.0, clock=clock)
    return OffloadingManager(
        tiers, [LRUPolicy(2), LRUPolicy(16)], write_through=[False, True], breaker=breaker
    )


def _store(m: OffloadingManager, keys: list[bytes]) -> None:
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store([*(k for mv in out.moves for k in mv.keys), *out.stored_keys])
    plan = m.plan_write_through(64)
    m.complete_write_through([k for mv in plan for k in mv.keys])


def test_lookup_skips_a_suspended_tier_until_its_backoff_ends(tmp_path: Path) -> None:
    clock = Clock()
    m = _manager(tmp_path, clock)
    chain = [K(i) for i in range(6)]
    for i in range(0, 6, 2):  # the first tier holds 2: the head ends up in NVMe only
        _store(m, chain[i : i + 2])
    held = [m.where(k) for k in chain]
    assert held[:4] == [[1]] * 4 and held[4:] == [[0, 1]] * 2, held
    assert m.lookup(chain) == 6
    assert m.suspend(1) == 1.0
    assert m.lookup(chain) == 0  # the head lives only in the suspended tier: a miss
    assert m.lookup(chain[4:]) == 2  # held in the first tier too: served from there
    st = m.stats()
    assert st["nvme"]["suspensions"] == 1 and st["nvme"]["suspended_ms"] == 1000
    clock.t += 1.0
    assert m.lookup(chain) == 6  # back by itself
    assert m.stats()["nvme"]["suspended_ms"] == 0
    # A load comes from a tier not suspended where one holds the block.
    m.suspend(0)
    assert m.prepare_load(chain[4:]).tiers == (1, 1)
    m.complete_load(chain[4:])
    assert m.stats()["cpu"]["suspensions"] == 1
    for t in m.tiers:
        t.close()


# -- loads abandoned at the deadline --------------------------------------------------------
class Hang:
    """Makes a tier's reads block until released: a hung disk (or a stopped server)."""

    def __init__(self, tier) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        read = tier.read

        def hung_read(slots, dst, keys=None):
            self.entered.set()
            self.release.wait(30)
            return read(slots, dst, keys)

        tier.read = hung_read


@pytest.mark.parametrize("factor", [1, 2])
def test_a_load_past_its_deadline_never_writes_engine_blocks(tmp_path: Path, factor: int) -> None:
    nb = 16
    caches, _kv_first = make_kv("separate", nb, device="cpu")
    layout = KVLayout(caches, nb, factor)
    bb = layout.block_bytes
    nvme = NVMeTier(path=str(tmp_path / "nvme"), block_bytes=bb, capacity_blocks=8, fsync="never")
    lmdb = LMDBTier(path=str(tmp_path / "lmdb"), block_bytes=bb, capacity_blocks=8)
    rows = torch.randint(0, 256, (4, bb), dtype=torch.uint8)
    keys = [K(i) for i in range(4)]
    slots = {}
    for t in (nvme, lmdb):
        s = t.allocate(keys)
        assert s is not None
        t.write(s, rows, keys)
        slots[t.medium] = s
    hang = Hang(nvme)
    before = torch.empty_like(rows)
    ids = list(range(4 * factor))
    layout.gather(ids, before)
    with build_worker(layout, [nvme, lmdb]) as worker:
        assert worker.transfer_async(
            1, (TierLoadStoreSpec(0, "nvme", slots["nvme"], keys), GPULoadStoreSpec(ids))
        )
        assert hang.entered.wait(10)
        assert worker.wait([1], timeout=0.05) == {1}  # past its deadline, still running
        assert worker.cancel(1)
        # Another tier's load is not stuck behind the hung one (a lane per tier).
        other = list(range(8, 8 + 4 * factor))
        assert worker.transfer_async(
            2, (TierLoadStoreSpec(1, "lmdb", slots["lmdb"], keys), GPULoadStoreSpec(other))
        )
        assert worker.wait([2], timeout=10) == set()
        hang.release.set()  # the hung read returns good bytes, after the engine gave up
        assert worker.wait([1], timeout=10) == set()
        results = {r.job_id: r for r in worker.get_finished()}
        assert results[2].success and not results[1].success
        assert sorted(results[1].failed) == [0, 1, 2, 3]
    after = torch.empty_like(rows)
    layout.gather(ids, after)
    assert torch.equal(after, before)  # the abandoned load wrote nothing
    assert not torch.equal(after, rows)
    got = torch.empty_like(rows)
    layout.gather(other, got)
    assert torch.equal(got, rows)  # the other tier's load landed, verified bytes
    assert not new_threads()
    nvme.close()
    lmdb.close()


def test_pool_copies_are_not_cancellable(tmp_path: Path) -> None:
    caches, _ = make_kv("separate", 8, device="cpu")
    layout = KVLayout(caches, 8, 1)
    cpu = CPUTier(block_bytes=layout.block_bytes, capacity_blocks=4)
    with build_worker(layout, [cpu]) as worker:
        s = cpu.allocate([K(0)])
        assert worker.transfer_async(
            1, (TierLoadStoreSpec(0, "cpu", s, [K(0)]), GPULoadStoreSpec([0]))
        )
        worker.wait([1])
        assert not worker.cancel(1)  # reported or a memory copy: nothing to give up
        worker.get_finished()
