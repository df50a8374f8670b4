"""Cost-aware loading through the connector's parts (issue 16, item 2), without an engine: a
slow tier's hit is recomputed in "auto" mode once its cost is measured, and loaded in
"always" mode; the worker's samples reach a scheduler in another process."""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tiercache.config import CacheConfig
from tiercache.connectors.namespace import resolve_config
from tiercache.connectors.stores import SharedStore, acquire_store, release_store
from tiercache.connectors.vllm_kv import (
    KVScheduler,
    KVSettings,
    KVWorker,
    TierCacheWorkerMetadata,
)
from tiercache.costs import ForwardTimer

BLOCK_BYTES = 64
BLOCK_TOKENS = 4
DELAY_S = 0.05  # each read of the slow tier


def _connector(config: CacheConfig, shared: SharedStore | None) -> KVScheduler:
    """The scheduler role's lookup path alone; local placement when `shared` is given."""
    return KVScheduler(KVSettings(config, block_size=BLOCK_TOKENS, block_bytes=BLOCK_BYTES), shared)


def _ask_local(c: KVScheduler, keys: list[bytes]) -> int:
    """`_lookup_local` as vLLM calls it: again while it answers None (a read still runs)."""
    while (n := c._lookup_local(keys, "req")) is None:
        pass
    return n


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_a_slow_tier_is_declined_in_auto_mode_and_loaded_in_always_mode(
    tmp_path: Path, mode: str
) -> None:
    config = resolve_config(
        {
            "tiers": [{"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 16}],
            "promote": False,
            "loading": {"mode": mode},
        },
        block_size=BLOCK_TOKENS,
        namespace=f"cost-{mode}",
    )
    shared = acquire_store(config, BLOCK_BYTES)
    try:
        cache = shared.cache
        keys = cache.hash_tokens(list(range(4 * BLOCK_TOKENS)))  # 4 blocks
        cache.put(keys, torch.ones((4, BLOCK_BYTES), dtype=torch.uint8))
        nvme = cache.tiers[0]
        read, read_to = nvme.read, nvme.read_to

        def slow_read(slots, dst, keys=None):  # a slow disk (or network)
            time.sleep(DELAY_S)
            return read(slots, dst, keys)

        def slow_read_to(slots, sink, keys=None, **kw):  # the same for a CPU engine's loads
            time.sleep(DELAY_S)
            return read_to(slots, sink, keys, **kw)

        nvme.read, nvme.read_to = slow_read, slow_read_to
        # The engine's forward, as the worker measured it: 1 µs per token past 10 ms a step,
        # so recomputing the hit (16 tokens) costs 16 µs, far below one read of this tier.
        cache.load_costs.observe_forward(1000, 0.011)
        cache.load_costs.observe_forward(3000, 0.013)
        c = _connector(config, shared)
        # Cold: the tier was never measured, so the hit is loaded (read and verified here,
        # in the local placement), and that read is the tier's first measurement.
        assert _ask_local(c, keys) == 4
        assert c._stats.get("loading_cold_blocks", 0) == (4 if mode == "auto" else 0)
        assert cache.stats()["nvme"]["load_jobs"] == 1
        # That measurement is the slow read's: the tier's estimate for these 4 blocks is at
        # least the read's delay (one sample: all of it in the per-byte part of the line).
        line = cache.load_costs.estimates().load["nvme"]
        assert line.seconds(4 * BLOCK_BYTES) >= DELAY_S, line
        # Measured: at least 50 ms to load what 16 µs recompute. "auto" declines it all
        # (nothing read: the measurement stays one job); "always" loads it.
        got = _ask_local(c, keys)
        if mode == "auto":
            assert got == 0 and c._stats["loading_declined_blocks"] == 4
            assert cache.stats()["nvme"]["load_jobs"] == 1
        else:
            assert got == 4 and "loading_declined_blocks" not in c._stats
            assert c._stats["loading_blocks"] == 8
    finally:
        release_store(shared)


def test_worker_samples_reach_a_remote_scheduler_and_decide_there(tmp_path: Path) -> None:
    """Remote placement: the worker process measures, its metadata carries the samples, the
    scheduler's own estimates decide from the index's tiers."""
    # The scheduler knows the tiers by name: a fast one, and a slow remote one ("redis").
    tiers = [{"kind": "cpu", "blocks": 64}, {"kind": "cpu", "name": "redis", "blocks": 64}]
    sched_cfg = CacheConfig.from_mapping({"tiers": tiers, "loading": {"mode": "auto"}})
    worker_cfg = resolve_config({"tiers": tiers[:1]}, block_size=BLOCK_TOKENS, namespace="w")
    worker_shared = acquire_store(worker_cfg, BLOCK_BYTES)
    try:
        w = KVWorker(
            KVSettings(worker_cfg, block_size=BLOCK_TOKENS, block_bytes=BLOCK_BYTES), worker_shared
        )
        clock = iter([10.0, 10.1, 20.0, 20.2]).__next__  # two forwards: 0.1 s and 0.2 s
        w._timer = ForwardTimer(clock=clock)
        # Measured in the worker: the redis tier, 20 ms per job then 0.5 ms per block ...
        for n in (1, 2, 4, 8):
            w._load_samples.append(("redis", n * BLOCK_BYTES, 0.020 + n * 0.0005))
        # ... and two forwards, bound then saved as vLLM calls them: 1 ms per block's 4 tokens
        # past 10 ms.
        for tokens in (400, 800):
            w.bind()
            w._timer.stop(tokens)
        meta = pickle.loads(pickle.dumps(w.build_connector_worker_meta()))  # across processes
    finally:
        release_store(worker_shared)
    assert isinstance(meta, TierCacheWorkerMetadata) and len(meta.load_samples) == 4
    assert meta.forward_samples == [(400, pytest.approx(0.1)), (800, pytest.approx(0.2))]
    c = _connector(sched_cfg, None)
    k = [bytes([i]) * 16 for i in range(100)]
    c.update_connector_output(
        SimpleNamespace(
            kv_connector_worker_meta=meta.aggregate(
                TierCacheWorkerMetadata(events=[(0, tuple(k), "redis", False)])
            )
        )
    )
    # 10 blocks: 25 ms to load, 10 ms to recompute; 100 blocks: 70 ms against 100 ms.
    assert c._affordable(k[:10], 10) == 0
    assert c._affordable(k, 100) == 100
    assert c._stats == {"loading_declined_blocks": 10, "loading_blocks": 100}


def _engine_spec(model: Path, root: Path, mode: str, prompts: list[list[int]], **kw: Any) -> dict:
    root.mkdir()
    tiers = [
        {"kind": "cpu", "blocks": 8},
        {"kind": "nvme", "path": str(root / "nvme"), "blocks": 64},
    ]
    config = {"namespace": f"cost-{mode}", "tiers": tiers, "loading": {"mode": mode}}
    kv = {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": config},
    }
    batches = [
        # vLLM's own prefix cache is reset after the first batch: only tiercache can serve
        # the second one, as far as the mode lets it.
        {"prompts": prompts, "max_tokens": 8, "reset_prefix_cache": True},
        {"prompts": prompts, "max_tokens": 8},
    ]
    return {"model": str(model), "kv_transfer_config": kv, "batches": batches, **kw}


def test_engine_outputs_equal_with_loading_never_and_auto(
    engine: ModuleType, tiny_llama: Path, tmp_path: Path
) -> None:
    """The real engine: "never" recomputes every hit, "auto" (multiprocess: the estimates
    cross from the worker's process) loads what it finds worth it; greedy outputs are the
    same either way and equal the first, cold batch's."""
    prompts = engine.make_prompts(4, 200, seed=11, shared_prefix=64)
    # Two stores and namespaces: the engines run at the same time.
    never, auto = engine.run_together(
        [
            _engine_spec(tiny_llama, tmp_path / "n", "never", prompts),
            _engine_spec(tiny_llama, tmp_path / "a", "auto", prompts, multiprocessing=True),
        ]
    )
    cold, again = never["batches"]
    assert again["outputs"] == cold["outputs"]
    assert [b["outputs"] for b in auto["batches"]] == [cold["outputs"]] * 2
    # "never": every hit declined and recomputed; only vLLM's own cache served tokens.
    (store,) = never["stores"].values()
    c = store["counters"]
    # The first prompt asks for its 6 full blocks, the others for their 4 own ones.
    assert c["loading_declined_blocks"] == 6 + 3 * 4 and c.get("loaded_blocks", 0) == 0, c
    assert again["num_cached_tokens"] == cold["num_cached_tokens"]
    # "auto", multiprocess: the worker measured its forwards and whatever it loaded.
    (store,) = auto["stores"].values()
    loaded = store["counters"].get("loaded_blocks", 0)
    jobs = sum(int(t.get("load_jobs", 0)) for t in store["stats"].values())
    assert (loaded > 0) == (jobs > 0), store
