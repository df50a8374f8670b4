"""Nothing dropped while a lower tier has room (issue 19), end to end on a real vLLM CPU
engine: a first tier of 4 blocks in front of NVMe and LMDB, prompts of 9-19 full blocks sent
together. What the first tier cannot take is written around it, so a fresh process hits
every full block; with write-through, a SIGKILLed engine loses nothing it had
copied down. Both in process and in vLLM's default multiprocess mode."""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm")

BLOCK = 32
FULL_BLOCKS = [9, 11, 13, 15, 17, 19]
# Head shards per block (tp_layout "auto"): the tiny Llama's 2 KV heads, one shard each.
SHARDS = 2


def _kv_config(root: Path, **nvme: Any) -> dict[str, Any]:
    tiers = [
        {"kind": "cpu", "blocks": 4},
        {"kind": "nvme", "path": str(root / "nvme"), "capacity": "64MiB", **nvme},
        {"kind": "lmdb", "path": str(root / "lmdb"), "capacity": "128MiB"},
    ]
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": {"namespace": "long", "tiers": tiers}},
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # 5 tokens past the last full block: every full block is loadable (the block holding
    # the last prompt token never is).
    rng = random.Random(19)
    return [[rng.randrange(3, 4096) for _ in range(n * BLOCK + 5)] for n in FULL_BLOCKS]


@pytest.fixture(scope="module")
def baseline(engine: ModuleType, tiny_llama: Path, prompts: list[list[int]]) -> list[list[int]]:
    spec = {"model": str(tiny_llama), "batches": [{"prompts": prompts, "max_tokens": 8}]}
    return engine.run_in_subprocess(spec)["batches"][0]["outputs"]


def _spec(model: Path, kv: dict[str, Any], prompts: list[list[int]], **kw: Any) -> dict:
    batches = [{"prompts": prompts, "max_tokens": 8}]
    return {"model": str(model), "kv_transfer_config": kv, "batches": batches, **kw}


@pytest.mark.parametrize(
    "store_mp,load_mp", [(False, True), (True, False)], ids=["store-inproc", "store-mp"]
)
def test_a_fresh_process_hits_chains_longer_than_the_first_tier(
    engine: ModuleType,
    tiny_llama: Path,
    tmp_path: Path,
    prompts: list[list[int]],
    baseline: list[list[int]],
    store_mp: bool,
    load_mp: bool,
) -> None:
    kv = _kv_config(tmp_path)
    store_spec = _spec(tiny_llama, kv, prompts, multiprocessing=store_mp)
    # generate() returns before the last saves land (vLLM holds those blocks until they do):
    # resetting vLLM's prefix cache waits for every save, so the counters below are final.
    store_spec["batches"][0]["reset_prefix_cache"] = True
    stored = engine.run_in_subprocess(store_spec)
    assert stored["batches"][0]["outputs"] == baseline
    loaded = engine.run_in_subprocess(_spec(tiny_llama, kv, prompts, multiprocessing=load_mp))
    (batch,) = loaded["batches"]
    assert batch["outputs"] == baseline
    full = sum(FULL_BLOCKS) * BLOCK
    hit = sum(batch["num_cached_tokens"])
    print(f"long chains ({'mp' if load_mp else 'in-process'} load): {hit} of {full} tokens hit")
    # Every full block of every prompt: all were stored (below), and the lower tiers hold
    # them all. Before write-around: 4 blocks per prompt, 768 of 2,688 (29 %).
    assert batch["num_cached_tokens"] == [n * BLOCK for n in FULL_BLOCKS], (hit, full)
    if not store_mp:  # the in-process engine reports its cache's counters
        (store,) = stored["stores"].values()
        assert store["counters"].get("store_skipped_blocks", 0) == 0
        assert store["counters"]["stored_blocks"] == sum(FULL_BLOCKS)


@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_write_through_survives_a_sigkilled_engine(
    engine: ModuleType,
    tiny_llama: Path,
    tmp_path: Path,
    prompts: list[list[int]],
    baseline: list[list[int]],
    kind: str,
) -> None:
    # Everything fits the volatile first tier, so only write-through puts blocks on disk.
    kv = _kv_config(tmp_path)
    tiers = kv["kv_connector_extra_config"]["config"]["tiers"]
    tiers[0]["blocks"] = 256
    if kind == "lmdb":
        del tiers[1]  # cpu -> lmdb: LMDB is the tier written through
    # Once the stores are done (the prefix-cache reset waits for them) and the write-through
    # copier has run what they queued (settle_through; a one-token prompt stores nothing),
    # the counters are read and the engine is killed: no shutdown, no close.
    batches = [
        {"prompts": prompts, "max_tokens": 8, "reset_prefix_cache": True},
        {"prompts": [[3]], "max_tokens": 1, "settle_through": True},
    ]
    killed = engine.run_in_subprocess(
        {"model": str(tiny_llama), "kv_transfer_config": kv, "batches": batches, "sigkill": True}
    )
    assert killed["batches"][0]["outputs"] == baseline
    (store,) = killed["stores"].values()
    # Every full block was stored into the first tier and copied down (5 tokens past the last
    # full block and 8 generated: no block completes while decoding).
    # (The connector counts blocks; a tier counts what it holds: SHARDS head shards each.)
    through = store["stats"][kind]["written_through"]
    assert store["counters"]["stored_blocks"] == sum(FULL_BLOCKS), store["counters"]
    assert through == sum(FULL_BLOCKS) * SHARDS, store["stats"]
    through //= SHARDS
    fresh = engine.run_in_subprocess(_spec(tiny_llama, kv, prompts))
    (batch,) = fresh["batches"]
    assert batch["outputs"] == baseline
    hit_blocks = sum(batch["num_cached_tokens"]) // BLOCK
    print(f"sigkill {kind}: {through} blocks written through, {hit_blocks} hit after restart")
    # Every block copied down before the kill comes back.
    assert batch["num_cached_tokens"] == [n * BLOCK for n in FULL_BLOCKS], batch
