"""A block the cache's write-through thread is moving down into a hung tier is served from
its source slot by the vLLM adapters too (issue 35, item 2; the facade's and the manager's
part is in tests/test_moving_reads.py): the KV connector's lookup (its verifying read) and
its worker's load, and the OffloadingSpec's lookup and load. Real tiers: CPU, then NVMe
written through, then LMDB whose writes hang. The copy that reuses the block's slot waits for
the load's pin, so the bytes served are the block's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tests.test_deadlines import HangWrites
from tests.test_moving_reads import hung_lmdb_config
from tests.vllm.test_evicted_elsewhere import _offloading_config
from tiercache import TierCache
from tiercache.connectors.namespace import resolve_config
from tiercache.connectors.stores import acquire_store
from tiercache.connectors.vllm import TierCacheConnectorMetadata
from tiercache.connectors.vllm_kv import KVScheduler, KVSettings, KVWorker, LoadJob
from tiercache.connectors.vllm_offloading import offload_key_to_key


def _rows(n: int, bb: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, bb), dtype=torch.uint8, generator=g)


def _move_a_down(cache: TierCache, a: list[bytes], b: list[bytes], bb: int) -> HangWrites:
    """A in the CPU tier and NVMe; then B: its write-through copy into NVMe moves A's head
    down into LMDB, whose write hangs (A's head leaves its NVMe slot)."""
    hang = HangWrites(cache.tiers[2])
    cache.put(a, _rows(2, bb, 1))
    cache.flush()
    cache.put(b, _rows(2, bb, 2))
    assert hang.entered.wait(10)
    assert cache.manager.is_moving(a[0]) and cache.manager.where(a[1]) == [1]
    return hang


def test_kv_connector_serves_a_block_moving_into_a_hung_tier(tmp_path: Path) -> None:
    bb = 1024
    config = resolve_config(hung_lmdb_config(tmp_path), block_size=4, namespace="moving-kv")
    shared = acquire_store(config, bb)
    # Local placement: both roles in this process, each with its reference to the store.
    settings = KVSettings(config, block_size=4, block_bytes=bb, num_blocks=8)
    w, s = KVWorker(settings, shared), KVScheduler(settings, acquire_store(config, bb))
    engine = torch.zeros((8, bb), dtype=torch.uint8)
    hang = None
    try:
        w.register_kv_caches({"model.layers.0.attn": engine})
        cache = shared.cache
        a, b = cache.hash_tokens(list(range(8))), cache.hash_tokens(list(range(100, 108)))
        hang = _move_a_down(cache, a, b, bb)
        # 1. The scheduler's lookup: a hit of both (the verifying read serves A's head from
        #    its NVMe slot), not "ask again" until the move is given up.
        got = None
        for _ in range(200):
            if (got := s._lookup_local(a, "r")) is not None:
                break
        assert got == 2
        # 2. The load, pinned as the scheduler pins it, lands A's bytes in engine blocks.
        with shared.lock:
            spec = cache.manager.prepare_load(a, leaving=True)
        w.bind()
        w.start_load_kv(TierCacheConnectorMetadata(loads=[LoadJob("r", tuple(a), (3, 4), spec)]))
        assert w.get_block_ids_with_load_errors() == set()
        assert torch.equal(engine[3:5], _rows(2, bb, 1))
        assert cache.stats()["nvme"]["errors"] == 0
    finally:
        if hang is not None:
            hang.release.set()
        w.shutdown()
        s.shutdown()


def _kv_caches() -> CanonicalKVCaches:
    tensors = [torch.zeros((16, 256), dtype=torch.int8) for _ in range(2)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, 256) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)]],
    )


def test_offloading_spec_serves_a_block_moving_into_a_hung_tier(tmp_path: Path) -> None:
    config = _offloading_config(hung_lmdb_config(tmp_path))
    kv = _kv_caches()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(kv)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    ctx = ReqContext(req_id="r")
    hang = None
    try:
        cache = manager.cache
        ns, bb = cache.config.namespace, cache.block_bytes
        okeys = [make_offload_key(f"m{i}".encode().ljust(32, b"."), 0) for i in range(4)]
        keys = [offload_key_to_key(ns, k) for k in okeys]
        hang = _move_a_down(cache, keys[:2], keys[2:], bb)
        # Hits (A's head verified from the NVMe slot it is leaving), not HIT_PENDING.
        assert [manager.lookup(k, ctx) for k in okeys[:2]] == [LookupResult.HIT] * 2
        load = manager.prepare_load(okeys[:2], ctx)
        assert worker.submit_load(
            1, load, GPULoadStoreSpec([5, 6], group_sizes=[2], block_indices=[0])
        )
        results: list[Any] = []
        while not results:
            worker.wait({1})
            results = worker.get_finished()
        assert results[0].success
        manager.complete_load(okeys[:2], ctx)
        got = torch.cat([t.tensor[5:7].view(torch.uint8) for t in kv.tensors], dim=1)
        assert torch.equal(got, _rows(2, bb, 1))
        assert cache.stats()["nvme"]["errors"] == 0
    finally:
        if hang is not None:
            hang.release.set()
        worker.shutdown()
        manager.shutdown()
