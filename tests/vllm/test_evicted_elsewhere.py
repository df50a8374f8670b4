"""A block another process evicted from a shared LMDB store is a plain miss in the vLLM
adapters' worker paths too (the facade's are in tests/test_evicted_elsewhere.py): the load
that meets it fails only those blocks (the KV connector's vLLM recomputes them), no error is
counted against the tier, and its circuit breaker stays closed. One rule decides it,
`Tier.sort_failed`, applied on the transfer engine's thread that read.

Each test opens the store twice in this process, in the unlucky order: instance A stores,
then the adapter's cache B opens (it finds A's blocks and indexes them), then A's stores
evict them (the store's capacity is shared) while B's index still holds them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
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
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tiercache import TierCache
from tiercache.connectors.namespace import resolve_config
from tiercache.connectors.stores import acquire_store, store_snapshots
from tiercache.connectors.vllm import TierCacheConnectorMetadata
from tiercache.connectors.vllm_kv import KVSettings, KVWorker, LoadJob
from tiercache.connectors.vllm_offloading import TierCacheOffloadingSpec, offload_key_to_key
from tiercache.tiers.lmdb import layout as lmdb_tier

CAP = 4  # blocks the shared store keeps per namespace


def _lmdb(path: Path) -> dict[str, Any]:
    return {"tiers": [{"kind": "lmdb", "path": str(path), "blocks": CAP}]}


def _rows(n: int, bb: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, bb), dtype=torch.uint8, generator=g)


def _healthy(cache: TierCache) -> None:
    st = cache.stats()["lmdb"]
    assert st["errors"] == 0, st
    assert st["suspensions"] == 0 and st["suspended_ms"] == 0, st
    assert cache.manager.suspended() == [0.0]


# -- TierCacheConnector ------------------------------------------------------------------------
def test_kv_connector_load_of_a_block_evicted_elsewhere_is_a_miss(tmp_path: Path) -> None:
    bb = 1024
    config = resolve_config(_lmdb(tmp_path / "env"), block_size=4, namespace="gone-kv")
    a = TierCache.open(config, block_bytes=bb)
    keys = a.hash_tokens(list(range(8 * 4)))
    a.put(keys[:CAP], _rows(CAP, bb, 1))
    shared = acquire_store(config, bb)  # B opens after A stored: it indexes A's blocks
    c = KVWorker(KVSettings(config, block_size=4, block_bytes=bb, num_blocks=8), shared)
    try:
        c.register_kv_caches({"model.layers.0.attn": torch.zeros((8, bb), dtype=torch.uint8)})
        cache = shared.cache
        with shared.lock:
            assert cache.manager.lookup(keys[:CAP], count=False) == CAP
        a.put(keys[CAP : 2 * CAP], _rows(CAP, bb, 2))  # the store evicts keys[:CAP]
        # The scheduler pinned the hit (local placement); the worker loads it, synchronously.
        with shared.lock:
            spec = cache.manager.prepare_load(keys[:2])
        block_ids = (5, 6)
        c.bind()
        c.start_load_kv(
            TierCacheConnectorMetadata(loads=[LoadJob("r", tuple(keys[:2]), block_ids, spec)])
        )
        # vLLM recomputes both blocks; they are plain misses: no error, the tier healthy.
        assert c.get_block_ids_with_load_errors() == set(block_ids)
        data = c.take_stats()
        assert data.get("load_error_blocks", 0) == 0, data
        assert data.get("load_gone_blocks") == 2, data
        c._drain()  # drops them from the index once unpinned
        _healthy(cache)
        with shared.lock:
            assert cache.manager.lookup(keys[:2], count=False) == 0
    finally:
        c.shutdown()
        a.close()


# -- TierCacheOffloadingSpec -------------------------------------------------------------------
PAGE = 256
CTX = ReqContext(req_id="r")


def _offloading_config(tier_config: dict[str, Any]) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=2 * PAGE,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TierCacheOffloadingSpec",
            "spec_module_path": "tiercache.connectors.vllm",
            "config": tier_config,
        },
        engine_id="engine-0",
        model=OffloadingModelConfig(name="tiny-llama", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
        kv_cache_layout="LBHNC",
    )


def _kv_caches() -> CanonicalKVCaches:
    tensors = [torch.zeros((16, PAGE), dtype=torch.int8) for _ in range(2)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]],
    )


def test_offloading_spec_lookup_and_load_of_a_block_evicted_elsewhere(tmp_path: Path) -> None:
    config = _offloading_config(_lmdb(tmp_path / "env"))
    spec = TierCacheOffloadingSpec(config)  # its cache config only: nothing opened yet
    ns, bb = spec.cache_config.namespace, spec.block_bytes
    okeys = [make_offload_key(f"b{i}".encode().ljust(32, b"."), 0) for i in range(2 * CAP)]
    keys = [offload_key_to_key(ns, k) for k in okeys]
    a = TierCache.open(spec.cache_config, block_bytes=bb)
    a.put(keys[:CAP], _rows(CAP, bb, 1))
    # B: the spec's two halves, as vLLM builds them, opened after A stored.
    worker = OffloadingSpecFactory.create_spec(config).get_worker(_kv_caches())
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        cache = manager.cache
        # 1. B's lookups verify the blocks (a read each): hits.
        assert all(manager.lookup(k, CTX) is LookupResult.HIT for k in okeys[:2])
        a.put(keys[CAP : 2 * CAP], _rows(CAP, bb, 2))  # the store evicts keys[:CAP]
        # 2. A lookup reading a block the store evicted: a miss, no error.
        assert manager.lookup(okeys[2], CTX) is LookupResult.MISS
        _healthy(cache)
        # 3. A load of blocks verified before the eviction: vLLM's connector cannot recompute
        # a failed load (see the spec's docstring), but the tier is not to blame: no error.
        load = manager.prepare_load(okeys[:2], CTX)
        dst = GPULoadStoreSpec([3, 4], group_sizes=[2], block_indices=[0])
        assert worker.submit_load(1, load, dst)
        results: list[Any] = []
        while not results:
            worker.wait({1})
            results = worker.get_finished()
        assert not results[0].success
        manager.complete_load(okeys[:2], CTX)
        manager.lookup(okeys[0], CTX)  # the manager half applies the worker's reports
        counters = store_snapshots()[ns]["counters"]
        assert counters["offload_load_failures"] == 2
        _healthy(cache)
    finally:
        worker.shutdown()
        manager.shutdown()
        a.close()


# -- end to end: engines sharing one LMDB store ------------------------------------------------
def _held(path: Path) -> set[bytes]:
    """The blocks (store keys) an LMDB store holds, read without its lock: between engines,
    while none writes."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4, subdir=True)
    try:
        heads = env.open_db(lmdb_tier.HEADS_DB, create=False)
        with env.begin() as txn:
            return {bytes(k) for k, _ in txn.cursor(db=heads)}
    finally:
        env.close()


def test_engines_sharing_a_store_see_blocks_another_evicted_as_plain_misses(
    engine: Any, tiny_llama: Path, tmp_path: Path
) -> None:
    """Engine A stores a prompt set into a shared LMDB store and exits; engine B opens the
    store after (it indexes A's blocks); engine C stores another set, and the store's shared
    capacity evicts A's blocks; then B serves A's prompts: identical outputs, recomputed, and
    no error counted, no tier suspended, no load error (a busy fleet does not look broken)."""
    first = engine.make_prompts(4, 300, seed=61)
    other = engine.make_prompts(4, 300, seed=62)
    warm = engine.make_prompts(1, 40, seed=63)
    lmdb = {"kind": "lmdb", "path": str(tmp_path / "shared"), "blocks": 40}
    kv = engine.tiercache_kv(
        {"namespace": "gone-e2e", "tiers": [{"kind": "cpu", "blocks": 4}, lmdb]}
    )

    def spec(batches: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": str(tiny_llama), "kv_transfer_config": kv, "batches": batches}

    # A, and at the same time an engine without tiercache (the outputs to match).
    base, _ = engine.run_together(
        [
            {"model": str(tiny_llama), "batches": [{"prompts": first, "max_tokens": 4}]},
            spec([{"prompts": first, "max_tokens": 4}]),
        ]
    )
    want = base["batches"][0]["outputs"]
    by_a = _held(tmp_path / "shared")
    ready, evicted = tmp_path / "ready", tmp_path / "evicted"
    b = engine.start_in_subprocess(
        spec(
            [
                {"prompts": warm, "max_tokens": 2, "touch": str(ready)},
                {"prompts": first, "max_tokens": 4, "wait_for": str(evicted)},
            ]
        )
    )
    try:
        b.wait_for(ready, 300)
        engine.run_in_subprocess(spec([{"prompts": other, "max_tokens": 4}]))  # C evicts A's
        after_c = _held(tmp_path / "shared")
        evicted.touch()
        result = b.result(600)
    finally:
        b.kill()
    served = result["batches"][1]
    (store,) = result["stores"].values()
    # The scenario happened: C's stores made the shared store evict A's blocks (by write
    # order, so every prompt's first block), and B served none of them. B meets them at its
    # lookups (the probe of a shared tier finds them gone: plain misses), not at a load, so
    # no `load_gone_blocks` here; the load path is the unit test above.
    gone = by_a - after_c
    assert gone and len(gone) > len(by_a) // 2, (len(by_a), len(after_c), len(gone))
    assert served["num_cached_tokens"] == [0] * len(first), served["num_cached_tokens"]
    assert store["stats"]["lmdb"]["hits"] == 0 and store["stats"]["lmdb"]["misses"] > 0, store
    assert served["outputs"] == want
    for store in result["stores"].values():
        assert store["counters"].get("load_error_blocks", 0) == 0, store["counters"]
        for medium, st in store["stats"].items():
            assert st["errors"] == 0 and st["suspensions"] == 0, (medium, st)
