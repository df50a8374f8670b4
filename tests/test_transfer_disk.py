"""The disk handler: tier <-> tier through `Tier.read/write` (demotions), engine <-> pool-less
tiers through staging, read failures per block, and the real NVMe/LMDB tiers when present."""

from __future__ import annotations

import time

import pytest
import torch

from tests.test_transfer_common import (
    DictTier,
    K,
    assert_blocks,
    drain,
    make_kv,
    new_threads,
    snapshot,
)
from tiercache.config import CacheConfig
from tiercache.errors import ConfigError
from tiercache.tiers import build_tier
from tiercache.tiers.cpu import CPUTier
from tiercache.tiers.gpu import GPUTier
from tiercache.transfer import (
    ENGINE_MEDIUM,
    DiskHandler,
    GPULoadStoreSpec,
    KVLayout,
    OffloadingWorker,
    TierLoadStoreSpec,
    build_worker,
)

NB = 32


def spec(tier: int, medium: str, slots, keys=None) -> TierLoadStoreSpec:
    return TierLoadStoreSpec(tier, medium, slots, keys or [K(s) for s in slots])


def persistent_tier(kind: str, block_bytes: int, tmp_path):
    if kind == "dict":
        return DictTier(name="disk", block_bytes=block_bytes, capacity_blocks=16)
    if kind == "gpu_twin":
        return GPUTier(name="disk", block_bytes=block_bytes, capacity_blocks=16, device="cpu")
    try:
        cfg = CacheConfig.load(
            {
                "block_size": 16,
                "namespace": "transfer-test",
                "tiers": [
                    {"kind": kind, "name": "disk", "blocks": 16, "path": str(tmp_path / kind)}
                ],
            }
        )
        return build_tier(cfg.tiers[0], block_bytes, namespace=cfg.namespace)
    except ConfigError as exc:  # the tier's module is not there yet (or cannot run here)
        pytest.skip(f"{kind} tier unavailable: {exc}")


@pytest.mark.parametrize("kind", ["dict", "gpu_twin", "nvme", "lmdb"])
def test_cpu_tier_to_persistent_tier_and_back(kind: str, tmp_path) -> None:
    caches, kv_first = make_kv("kv_separate", NB)
    layout = KVLayout(caches, NB, 2)
    cpu = CPUTier(block_bytes=layout.block_bytes, capacity_blocks=8)
    disk = persistent_tier(kind, layout.block_bytes, tmp_path)
    a, b, c, d = list(range(0, 6)), list(range(8, 14)), list(range(16, 22)), list(range(24, 30))
    want_a, want_c = snapshot(caches, kv_first, a), snapshot(caches, kv_first, c)
    keys_a, keys_c = [K(100 + i) for i in range(3)], [K(200 + i) for i in range(3)]
    # Two-row staging chunks so the 3-block jobs run in more than one chunk.
    worker = build_worker(layout, [cpu, disk], chunk_bytes=2 * layout.block_bytes)
    try:
        # Engine A -> cpu slots -> disk slots -> engine B, all submitted at once.
        worker.transfer_async(1, (GPULoadStoreSpec(a), spec(0, "cpu", [0, 1, 2], keys_a)))
        worker.transfer_async(
            2, (spec(0, "cpu", [0, 1, 2], keys_a), spec(1, "disk", [5, 9, 3], keys_a))
        )
        worker.transfer_async(3, (spec(1, "disk", [5, 9, 3], keys_a), GPULoadStoreSpec(b)))
        # Engine C -> disk directly (a first tier without a pool), and back into D.
        worker.transfer_async(4, (GPULoadStoreSpec(c), spec(1, "disk", [0, 1, 2], keys_c)))
        worker.transfer_async(5, (spec(1, "disk", [0, 1, 2], keys_c), GPULoadStoreSpec(d)))
        res = drain(worker, [1, 2, 3, 4, 5])
    finally:
        worker.close()
        disk.close()
    assert {i: r.success for i, r in res.items()} == dict.fromkeys(range(1, 6), True)
    assert res[2].transfer_type == ("cpu", "disk")
    assert res[2].transfer_size == 3 * layout.block_bytes
    assert_blocks(caches, kv_first, b, want_a)
    assert_blocks(caches, kv_first, d, want_c)
    assert not new_threads()


def make_pair(bad_slots=(), raise_on_read=False):
    caches, kv_first = make_kv("separate", NB)
    layout = KVLayout(caches, NB)
    cpu = CPUTier(block_bytes=layout.block_bytes, capacity_blocks=8)
    disk = DictTier(block_bytes=layout.block_bytes, capacity_blocks=8)
    disk.bad_slots = set(bad_slots)
    disk.raise_on_read = raise_on_read
    return caches, kv_first, layout, cpu, disk


def test_failed_positions_fail_the_load_and_are_never_written() -> None:
    caches, kv_first, layout, cpu, disk = make_pair(bad_slots={2})
    worker = build_worker(layout, [cpu, disk])
    try:
        for i in range(4):  # fill disk slots 0..3 with engine blocks 0..3
            worker.transfer_async(i, (GPULoadStoreSpec([i]), spec(1, "dict", [i])))
        drain(worker, [0, 1, 2, 3])
        before = snapshot(caches, kv_first, [10, 11, 12, 13])
        cpu_before = cpu.pool.clone()
        worker.transfer_async(
            10, (spec(1, "dict", [0, 1, 2, 3]), GPULoadStoreSpec([10, 11, 12, 13]))
        )
        worker.transfer_async(11, (spec(1, "dict", [0, 1, 2, 3]), spec(0, "cpu", [4, 5, 6, 7])))
        res = drain(worker, [10, 11])
    finally:
        worker.close()
    # The load fails as a whole (the scheduler recomputes); position 2 is named.
    assert not res[10].success and res[10].failed == (2,)
    assert res[10].transfer_size == 3 * layout.block_bytes
    assert_blocks(caches, kv_first, [12], [before[2]])  # the bad block never reached the engine
    # The move lands the three good blocks; the bad one's slot is left untouched.
    assert not res[11].success and res[11].failed == (2,)
    assert torch.equal(cpu.pool[6], cpu_before[6])
    assert not torch.equal(cpu.pool[4], cpu_before[4])


def test_read_error_fails_every_block_of_the_chunk() -> None:
    _caches, _kv_first, layout, cpu, disk = make_pair(raise_on_read=True)
    worker = OffloadingWorker()
    h = DiskHandler([cpu, disk], layout)
    worker.register_handler("dict", ENGINE_MEDIUM, h)
    worker.register_handler("dict", "cpu", h)
    try:
        worker.transfer_async(1, (spec(1, "dict", [0, 1]), GPULoadStoreSpec([3, 4])))
        worker.transfer_async(2, (spec(1, "dict", [0, 1]), spec(0, "cpu", [0, 1])))
        res = drain(worker, [1, 2])
    finally:
        worker.close()
    assert [(r.success, r.failed, r.transfer_size) for r in res.values()] == [
        (False, (0, 1), 0),
        (False, (0, 1), 0),
    ]


def test_slow_disk_does_not_block_submission() -> None:
    _caches, _kv_first, layout, cpu, disk = make_pair()
    disk.read_delay = 0.3
    worker = build_worker(layout, [cpu, disk])
    try:
        t0 = time.perf_counter()
        for i in range(4):
            assert worker.transfer_async(i, (spec(1, "dict", [i]), GPULoadStoreSpec([i])))
        assert time.perf_counter() - t0 < 0.1
        drain(worker, [0, 1, 2, 3])
    finally:
        worker.close()


def test_disk_handler_validation() -> None:
    _caches, _kv_first, layout, cpu, disk = make_pair()
    other = DictTier(name="other", block_bytes=layout.block_bytes + 8, capacity_blocks=4)
    h = DiskHandler([cpu, disk, other], layout)
    worker = OffloadingWorker()
    worker.register_handler("dict", "other", h)
    worker.register_handler("dict", "cpu", h)
    try:
        with pytest.raises(ValueError, match="block sizes differ"):
            worker.transfer_async(1, (spec(1, "dict", [0]), spec(2, "other", [0])))
        with pytest.raises(ValueError, match="destination slots"):
            worker.transfer_async(1, (spec(1, "dict", [0, 1]), spec(0, "cpu", [0])))
        with pytest.raises(ValueError, match="slots outside"):
            worker.transfer_async(1, (spec(1, "dict", [0]), spec(0, "cpu", [8])))
    finally:
        worker.close()
    with pytest.raises(ValueError, match="threads"):
        DiskHandler([cpu], threads=0)


def test_a_second_namespace_on_a_full_nvme_store_stores_and_loads(tmp_path) -> None:
    # Namespace "a" fills the store; "b" (another model, a changed config) then opens it: a's
    # blocks are kept in their slots, so b's are numbered past the capacity. The transfer
    # engine refused them ("slots outside tier"), so b stored and loaded nothing.
    from tiercache.tiers.nvme import NVMeTier

    caches, kv_first = make_kv("kv_separate", NB)
    layout = KVLayout(caches, NB, 2)
    path, bb = str(tmp_path / "nvme"), layout.block_bytes
    a = NVMeTier(name="nvme", path=path, block_bytes=bb, capacity_blocks=4, namespace="a")
    keys_a = [K(i) for i in range(4)]
    a.write(a.allocate(keys_a), torch.ones(4, bb, dtype=torch.uint8), keys_a)
    a.close()
    b = NVMeTier(name="nvme", path=path, block_bytes=bb, capacity_blocks=4, namespace="b")
    keys_b = [K(100 + i) for i in range(2)]
    slots = b.allocate(keys_b)
    assert slots is not None and max(slots) >= b.capacity_blocks < b.slot_count
    src, dst = [0, 1, 2, 3], [8, 9, 10, 11]  # two slots of two engine blocks each
    want = snapshot(caches, kv_first, src)
    worker = build_worker(layout, [b])
    try:
        worker.transfer_async(1, (GPULoadStoreSpec(src), spec(0, "nvme", slots, keys_b)))
        worker.transfer_async(2, (spec(0, "nvme", slots, keys_b), GPULoadStoreSpec(dst)))
        got = drain(worker, [1, 2])
        assert all(r.success for r in got.values())
        assert_blocks(caches, kv_first, dst, want)
    finally:
        worker.close()
        b.close()
    # a's blocks are still there for a.
    a = NVMeTier(name="nvme", path=path, block_bytes=bb, capacity_blocks=4, namespace="a")
    try:
        assert sorted(k for k, _ in a.recover()) == sorted(keys_a)
    finally:
        a.close()
