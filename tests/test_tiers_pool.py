"""CPU and GPU pool tiers: the shared conformance suite, state machines, and device rules."""

from __future__ import annotations

import time

import pytest
import torch

from tests.tier_conformance import TierConformance, rand_blocks, tier_state_machine
from tiercache.config import CacheConfig
from tiercache.errors import ConfigError, TierUnavailableError
from tiercache.tiers import build_tier, tier_class
from tiercache.tiers.cpu import CPUTier
from tiercache.tiers.gpu import GPUTier

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class TestCPUTier(TierConformance):
    def make_tier(self, capacity_blocks, block_bytes, tmp_path):
        return CPUTier(block_bytes=block_bytes, capacity_blocks=capacity_blocks)

    def test_pool_is_one_contiguous_tensor(self, tier) -> None:
        assert tier.pool.shape == (8, self.block_bytes) and tier.pool.is_contiguous()
        assert tier.pinned == torch.cuda.is_available()


class TestGPUTierCPUTwin(TierConformance):
    """The GPU tier's code on its explicit CPU twin (device = "cpu")."""

    def make_tier(self, capacity_blocks, block_bytes, tmp_path):
        return GPUTier(block_bytes=block_bytes, capacity_blocks=capacity_blocks, device="cpu")


@cuda
class TestGPUTierCUDA(TierConformance):
    def make_tier(self, capacity_blocks, block_bytes, tmp_path):
        return GPUTier(block_bytes=block_bytes, capacity_blocks=capacity_blocks, device="cuda")

    def test_pool_on_device(self, tier) -> None:
        assert tier.pool.is_cuda


TestCPUTierMachine = tier_state_machine(
    lambda cap, bb: CPUTier(block_bytes=bb, capacity_blocks=cap)
).TestCase
TestCPUTierWideMachine = tier_state_machine(
    lambda cap, bb: CPUTier(block_bytes=bb, capacity_blocks=cap), block_bytes=64
).TestCase


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_gpu_tier_refuses_without_cuda() -> None:
    with pytest.raises(TierUnavailableError, match="CUDA is not available"):
        GPUTier(block_bytes=64, capacity_blocks=4)
    with pytest.raises(TierUnavailableError, match='device = "cpu"'):
        GPUTier(block_bytes=64, capacity_blocks=4, device="cuda:0")


@pytest.mark.parametrize("device", ["tpu", "mps", "not a device", "cuda:x"])
def test_gpu_tier_bad_device(device: str) -> None:
    with pytest.raises((ConfigError, TierUnavailableError), match="device"):
        GPUTier(block_bytes=64, capacity_blocks=4, device=device)


def test_registry_and_build() -> None:
    from tiercache.config import TierConfig

    assert tier_class("cpu") is CPUTier and tier_class("gpu") is GPUTier
    with pytest.raises(ConfigError, match="unknown tier kind 'tape'"):
        tier_class("tape")
    cfg = TierConfig.from_mapping({"kind": "gpu", "blocks": 3, "device": "cpu"}, 0)
    t = build_tier(cfg, 16)
    assert isinstance(t, GPUTier) and t.capacity_blocks == 3 and t.medium == "gpu"


def test_large_batch_is_one_copy_not_a_loop() -> None:
    """A 4096-block scattered batch round-trips (index_copy_/index_select, no Python loop)."""
    t = CPUTier(block_bytes=256, capacity_blocks=8192)
    slots = t.allocate([i.to_bytes(16, "big") for i in range(8192)])
    picked = slots[::2]
    data = rand_blocks(len(picked), 256, 9)
    t.write(picked, data)
    out = torch.empty_like(data)
    t.read(picked, out)
    assert torch.equal(out, data)


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_cpu_pool_is_faulted_in_behind_writes_without_touching_them() -> None:
    """Start-up (issue 16, item 5): the pool's pages are backed on a background thread, not
    in the constructor; blocks written meanwhile keep their bytes (MADV_POPULATE_WRITE backs
    pages without writing them, unlike the zeroing it replaces)."""
    import tiercache.tiers.pool as pool_mod

    bb, cap = 64 * 1024, 4096  # 256 MiB
    before = _rss_kib()
    # Pageable: a pinned pool (the default where CUDA is) is backed by its allocation.
    t = CPUTier(block_bytes=bb, capacity_blocks=cap, pin_memory=False)
    try:
        slots = [cap - 1, cap // 2, 7, cap - 2]  # far from the first chunk, faulted in later
        data = rand_blocks(len(slots), bb)
        t.write(slots, data)
        assert t.wait_prefaulted(60) and t.prefaulted
        out = torch.empty_like(data)
        t.read(slots, out)
        assert torch.equal(out, data)
        assert _rss_kib() - before > 0.9 * cap * bb / 1024  # every page is backed now
    finally:
        t.close()
    assert cap * bb > pool_mod.POPULATE_CHUNK  # the test spans several chunks


def test_cpu_pool_zeroes_where_the_kernel_refuses_to_prefault(monkeypatch) -> None:
    import tiercache.tiers.pool as pool_mod

    monkeypatch.setattr(pool_mod, "MADV_POPULATE_WRITE", 0x7FFF)  # an advice no kernel knows
    t = CPUTier(block_bytes=4096, capacity_blocks=64)
    try:
        assert t._prefault is None and t.prefaulted
        assert int(t.pool.sum()) == 0  # zeroed in the constructor, as before
    finally:
        t.close()


def test_a_pool_past_the_hosts_memory_is_refused_before_allocating(monkeypatch) -> None:
    """A pinned allocation past the host's memory does not fail fast (on a GPU host a config
    asking for 1000 TiB pinned page after page for minutes): the size is checked first."""
    import tiercache.tiers.pool as pool_mod

    ram = pool_mod.memory_bytes(torch.device("cpu"))
    assert ram is not None and ram > 0
    allocated: list[tuple] = []
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real(*a, **k))
    mib = 1 << 20
    for pinned in (False, True):  # pinned is refused the same way, with or without CUDA
        with pytest.raises(MemoryError, match=r"exceed the \d+ bytes of host memory"):
            CPUTier(block_bytes=mib, capacity_blocks=ram // mib + 1, pin_memory=pinned)
    assert allocated == []
    monkeypatch.undo()
    t = CPUTier(block_bytes=mib, capacity_blocks=2, pin_memory=False)  # small ones still open
    assert t.capacity_blocks == 2
    t.close()


def test_an_engine_store_waits_for_its_memory_tiers_to_be_faulted_in(monkeypatch) -> None:
    """`SharedStore.wait_for_memory` (what both vLLM adapters' workers call before vLLM
    serves) returns once every pool is backed, and gives up after its timeout with a warning
    (the engine serves meanwhile)."""
    import threading

    import tiercache.tiers.pool as pool_mod
    from tiercache.connectors.stores import acquire_store, release_store

    config = CacheConfig.from_mapping(
        {"namespace": "wait", "tiers": [{"kind": "cpu", "capacity": "64MiB", "pin_memory": False}]}
    )
    shared = acquire_store(config, 64 * 1024)
    try:
        shared.wait_for_memory(60)
        assert shared.cache.tiers[0].prefaulted
    finally:
        release_store(shared)
    gate = threading.Event()  # a prefault that does not end until the test says so
    real = pool_mod._Prefault._run

    def held(self, a: int, end: int) -> None:
        gate.wait(30)
        real(self, a, end)

    monkeypatch.setattr(pool_mod._Prefault, "_run", held)
    shared = acquire_store(config, 64 * 1024)
    try:
        t0 = time.monotonic()
        shared.wait_for_memory(0.2)
        assert 0.2 <= time.monotonic() - t0 < 5 and not shared.cache.tiers[0].prefaulted
    finally:
        gate.set()
        release_store(shared)
