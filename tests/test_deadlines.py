"""Deadlines (issue 16, item 1): the circuit breaker, the manager skipping suspended tiers,
and loads into the engine that are abandoned at their deadline without writing engine blocks
later. Real NVMe and LMDB tiers with files; a read that blocks stands in for a hung disk."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from tests.test_transfer_common import K, make_kv, new_threads
from tiercache.config import CacheConfig, DeadlineConfig
from tiercache.errors import ConfigError
from tiercache.manager import OffloadingManager
from tiercache.manager.breaker import CircuitBreaker
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
        read, read_to = tier.read, tier.read_to

        def hung_read(slots, dst, keys=None):
            self.entered.set()
            self.release.wait(30)
            return read(slots, dst, keys)

        def hung_read_to(slots, sink, keys=None, **kw):  # a CPU engine's loads (one copy)
            self.entered.set()
            self.release.wait(30)
            return read_to(slots, sink, keys, **kw)

        tier.read, tier.read_to = hung_read, hung_read_to


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


# -- stores past their deadline --------------------------------------------------------------
class HangWrites:
    """Makes a tier's writes block until released (a hung disk), after counting them."""

    def __init__(self, tier) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        write = tier.write

        def hung_write(slots, blocks, keys=None):
            self.entered.set()
            self.release.wait(30)
            return write(slots, blocks, keys)

        tier.write = hung_write


def test_a_store_past_its_deadline_reads_no_more_engine_blocks(tmp_path: Path) -> None:
    """The engine gives up on a store into a hung disk: from `cancel` on, no engine block is
    read (vLLM reuses them at once); the chunk read before still lands, exact, and the
    blocks not read are failed, never written."""
    nb = 8
    caches, _ = make_kv("separate", nb, device="cpu")
    layout = KVLayout(caches, nb, 1)
    bb = layout.block_bytes
    nvme = NVMeTier(path=str(tmp_path / "nvme"), block_bytes=bb, capacity_blocks=8, fsync="never")
    keys = [K(i) for i in range(4)]
    slots = nvme.allocate(keys)
    assert slots is not None
    want = torch.empty((4, bb), dtype=torch.uint8)
    layout.gather(range(4), want)
    hang = HangWrites(nvme)
    with build_worker(layout, [nvme], disk_threads=1, chunk_bytes=2 * bb) as worker:
        assert worker.transfer_async(
            1, (GPULoadStoreSpec(list(range(4))), TierLoadStoreSpec(0, "nvme", slots, keys))
        )
        # Queued behind it on the hung lane: cancelled before it starts, it never runs.
        assert worker.transfer_async(
            2, (GPULoadStoreSpec([4]), TierLoadStoreSpec(0, "nvme", (slots[0],), (K(9),)))
        )
        assert hang.entered.wait(10)  # chunk 1 (blocks 0-1) read, its write hangs
        assert worker.wait([1, 2], timeout=0.05) == {1, 2}
        assert worker.cancel(1) and worker.cancel(2)
        # vLLM reuses the blocks: these bytes must reach no tier.
        for t in caches.values():
            t.fill_(7)
        hang.release.set()
        assert worker.wait([1, 2], timeout=10) == set()
        results = {r.job_id: r for r in worker.get_finished()}
    assert sorted(results[1].failed) == [2, 3] and sorted(results[2].failed) == [0]
    got = torch.empty((2, bb), dtype=torch.uint8)
    assert nvme.read(slots[:2], got, keys[:2]) == []
    assert torch.equal(got, want[:2])  # the chunk read before the deadline, exact
    assert not new_threads()
    nvme.close()


def test_a_store_waits_for_a_hung_demotion_only_until_it_has_read(tmp_path: Path) -> None:
    """A store into a slot that a move into a hung disk demotes from waits until that move
    has read the slot, not for its write (write after read)."""
    caches, _ = make_kv("separate", 8, device="cpu")
    layout = KVLayout(caches, 8, 1)
    bb = layout.block_bytes
    cpu = CPUTier(block_bytes=bb, capacity_blocks=2)
    nvme = NVMeTier(path=str(tmp_path / "nvme"), block_bytes=bb, capacity_blocks=8, fsync="never")
    old = cpu.allocate([K(0)])
    assert old is not None
    old_bytes = torch.full((1, bb), 5, dtype=torch.uint8)
    cpu.write(old, old_bytes, [K(0)])
    down = nvme.allocate([K(0)])
    assert down is not None
    hang = HangWrites(nvme)
    with build_worker(layout, [cpu, nvme]) as worker:
        assert worker.transfer_async(
            1,
            (TierLoadStoreSpec(0, "cpu", old, [K(0)]), TierLoadStoreSpec(1, "nvme", down, [K(0)])),
        )
        assert worker.transfer_async(
            2, (GPULoadStoreSpec([3]), TierLoadStoreSpec(0, "cpu", old, [K(1)]))
        )
        assert worker.wait([2], timeout=10) == set()  # done while the demotion still hangs
        assert worker.wait([1], timeout=0) == {1}
        hang.release.set()
        assert worker.wait([1], timeout=10) == set()
        assert all(r.success for r in worker.get_finished())
    got = torch.empty((1, bb), dtype=torch.uint8)
    assert nvme.read(down, got, [K(0)]) == [] and torch.equal(got, old_bytes)  # the old bytes
    want = torch.empty((1, bb), dtype=torch.uint8)
    layout.gather([3], want)
    assert cpu.read(old, got, [K(1)]) == [] and torch.equal(got, want)
    nvme.close()


def test_a_pool_copy_that_has_not_started_can_be_given_up(tmp_path: Path) -> None:
    """A memory copy waiting on a hung disk job (a load of slots a hung move fills) is
    cancelled before it starts: it never writes engine blocks."""
    caches, _ = make_kv("separate", 8, device="cpu")
    layout = KVLayout(caches, 8, 1)
    bb = layout.block_bytes
    cpu = CPUTier(block_bytes=bb, capacity_blocks=2)
    nvme = NVMeTier(path=str(tmp_path / "nvme"), block_bytes=bb, capacity_blocks=8, fsync="never")
    src = nvme.allocate([K(0)])
    assert src is not None
    nvme.write(src, torch.full((1, bb), 3, dtype=torch.uint8), [K(0)])
    dst = cpu.allocate([K(0)])
    assert dst is not None
    hang = Hang(nvme)
    before = torch.empty((1, bb), dtype=torch.uint8)
    layout.gather([2], before)
    with build_worker(layout, [cpu, nvme]) as worker:
        assert worker.transfer_async(
            1,
            (TierLoadStoreSpec(1, "nvme", src, [K(0)]), TierLoadStoreSpec(0, "cpu", dst, [K(0)])),
        )
        assert worker.transfer_async(
            2, (TierLoadStoreSpec(0, "cpu", dst, [K(0)]), GPULoadStoreSpec([2]))
        )
        assert hang.entered.wait(10)
        assert worker.cancel(2)
        hang.release.set()
        assert worker.wait([1, 2], timeout=10) == set()
        results = {r.job_id: r for r in worker.get_finished()}
    assert results[1].success and not results[2].success
    after = torch.empty((1, bb), dtype=torch.uint8)
    layout.gather([2], after)
    assert torch.equal(after, before)
    nvme.close()


def test_a_suspended_tier_takes_no_store_demotion_or_write_through(tmp_path: Path) -> None:
    clock = Clock()
    m = _manager(tmp_path, clock)
    _store(m, [K(0), K(1)])  # cpu full; both written through to nvme
    m.suspend(1)
    # Write-around into nvme is off: the chain longer than cpu stores only what cpu takes.
    out = m.prepare_store([K(i) for i in range(10, 14)])
    assert out is not None
    assert not out.around and not out.moves  # no write-around, no demotion into nvme
    assert len(out.stored_keys) == 2
    m.complete_store(out.stored_keys)
    assert m.plan_write_through(64) == []  # the copies wait for the tier
    clock.t += 1.0  # back: the queued copies go down
    plan = m.plan_write_through(64)
    assert sorted(k for mv in plan for k in mv.keys) == sorted(out.stored_keys)
    m.complete_write_through([k for mv in plan for k in mv.keys])
    # A suspended first tier (a single-tier disk store) takes nothing at all.
    solo = OffloadingManager(
        [NVMeTier(path=str(tmp_path / "solo"), block_bytes=64, capacity_blocks=4, fsync="never")],
        [LRUPolicy(4)],
        breaker=CircuitBreaker(1, clock=clock),
    )
    solo.suspend(0)
    assert solo.prepare_store([K(20)]) is None
    clock.t += 1.0
    assert solo.prepare_store([K(20)]) is not None
    for t in [*m.tiers, *solo.tiers]:
        t.close()


def test_a_hung_write_through_copy_suspends_its_tier_and_close_leaves_it(tmp_path: Path) -> None:
    """The write-through thread copying into a hung disk: `check_through` suspends that tier
    once the copy is past the deadline, and `close` waits for it at most `store_timeout`,
    then leaves the tier as it is instead of hanging the process."""
    from tiercache import TierCache

    tiers = [
        {"kind": "cpu", "blocks": 8},
        {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 8, "fsync": "never"},
    ]
    cache = TierCache.open(
        {"tiers": tiers, "deadlines": {"store_timeout": 0.3, "backoff": 5.0, "backoff_max": 5.0}},
        block_bytes=64,
    )
    hang = HangWrites(cache.tiers[1])
    try:
        keys = cache.hash_tokens(list(range(2 * cache.config.block_size)))
        cache.put(keys, torch.ones((2, 64), dtype=torch.uint8))
        assert hang.entered.wait(10)  # the copier is stuck in the disk
        assert cache.check_through(10.0) is None  # not late yet
        time.sleep(0.3)
        assert cache.check_through(0.3) == 1
        assert cache.manager.suspended()[1] > 0
        assert cache.get(keys).shape[0] == 2  # the cpu copies still serve
        t0 = time.monotonic()
        cache.close()
        assert time.monotonic() - t0 < 2.0
    finally:
        hang.release.set()
