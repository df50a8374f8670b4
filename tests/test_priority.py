"""Background copy threads run at a lower CPU priority than the engine's (tiercache.priority):
the write-through copier and the transfer engine's tier -> tier lanes, not the lanes that
load into the engine."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.test_transfer_common import K, make_kv
from tiercache import TierCache
from tiercache.priority import BACKGROUND_NICE, thread_nice
from tiercache.tiers.cpu import CPUTier
from tiercache.tiers.nvme import NVMeTier
from tiercache.transfer import GPULoadStoreSpec, KVLayout, TierLoadStoreSpec, build_worker

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="needs setpriority")


def _nice_of(prefix: str) -> list[int]:
    return [
        thread_nice(t.native_id)
        for t in threading.enumerate()
        if t.name.startswith(prefix) and t.native_id is not None
    ]


def _expected() -> int:
    return min(19, thread_nice(threading.get_native_id()) + BACKGROUND_NICE)


def test_the_write_through_thread_runs_below_the_callers_priority(tmp_path: Path) -> None:
    tiers = [
        {"kind": "cpu", "blocks": 8},
        {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 8, "fsync": "never"},
    ]
    cache = TierCache.open({"tiers": tiers}, block_bytes=64)
    try:
        keys = cache.hash_tokens(list(range(2 * cache.config.block_size)))
        cache.put(keys, torch.ones((2, 64), dtype=torch.uint8))
        copier = cache._through.thread  # this cache's (other tests' may still be closing)
        assert copier is not None and copier.native_id is not None
        deadline = time.monotonic() + 5
        while (got := thread_nice(copier.native_id)) != _expected():
            assert time.monotonic() < deadline, got
            time.sleep(0.01)
        assert thread_nice(threading.get_native_id()) < _expected()  # the caller is untouched
    finally:
        cache.close()


def test_tier_to_tier_lanes_run_below_engine_lanes(tmp_path: Path) -> None:
    caches, _ = make_kv("separate", 8, device="cpu")
    layout = KVLayout(caches, 8, 1)
    bb = layout.block_bytes
    cpu = CPUTier(block_bytes=bb, capacity_blocks=4)
    nvme = NVMeTier(path=str(tmp_path / "nvme"), block_bytes=bb, capacity_blocks=4, fsync="never")
    a, b = cpu.allocate([K(0)]), nvme.allocate([K(0)])
    assert a is not None and b is not None
    with build_worker(layout, [cpu, nvme]) as worker:
        worker.transfer_async(1, (GPULoadStoreSpec([0]), TierLoadStoreSpec(0, "cpu", a, [K(0)])))
        worker.transfer_async(
            2, (TierLoadStoreSpec(0, "cpu", a, [K(0)]), TierLoadStoreSpec(1, "nvme", b, [K(0)]))
        )
        worker.transfer_async(3, (TierLoadStoreSpec(1, "nvme", b, [K(0)]), GPULoadStoreSpec([1])))
        assert worker.wait([1, 2, 3], timeout=10) == set()
        assert all(r.success for r in worker.get_finished())
        mine = thread_nice(threading.get_native_id())
        assert _nice_of("tiercache-xfer-disk-io:cpu>nvme") == [_expected()] * 2
        assert _nice_of("tiercache-xfer-disk-io:nvme-") == [mine] * 2  # engine <-> nvme
        # Loads are waited for and stores hold the engine's blocks: both at full priority.
        assert set(_nice_of("tiercache-xfer-copy")) == {mine}
    nvme.close()
