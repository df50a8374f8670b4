"""Two vLLM CPU engine processes with different local tiers sharing one Redis tier.

A real `redis-server` on a free loopback port (conftest's `redis_url`: skipped, with the
reason, where it is not installed; a failure under CI). Engine A (CPU tier of 8 blocks +
Redis) serves the prompts first and exits: its CPU tier demotes into Redis while it runs, and
its close writes the rest back. Engine B, a separate process with other local tiers (CPU 4
blocks + LMDB + Redis), then gets external hits for prompts only A saw, served from Redis,
with outputs identical to an engine without tiercache.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm")

N_PROMPTS = 8  # conftest's llama_prompts
PROMPT_LEN = 200  # 6 full blocks of 32 per prompt
SHARED = 64  # two blocks common to all prompts
DISTINCT_BLOCKS = 2 + N_PROMPTS * 4


def _kv(tiers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": {"namespace": "redis-e2e", "tiers": tiers}},
    }


def _stat(result: dict[str, Any], medium: str, name: str) -> int:
    return sum(int(s["stats"][medium][name]) for s in result["stores"].values())


def test_second_engine_hits_what_the_first_stored_in_redis(
    engine: ModuleType,
    tiny_llama: Path,
    redis_url: str,
    tmp_path: Path,
    llama_prompts: list[list[int]],
    llama_outputs: list[list[int]],
) -> None:
    # conftest's prompt set, and its outputs without a connector (shared with other modules)
    prompts, want = llama_prompts, llama_outputs
    assert [len(p) for p in prompts] == [PROMPT_LEN] * N_PROMPTS
    one = [{"prompts": prompts, "max_tokens": 16}]

    redis_tier = {"kind": "redis", "url": redis_url, "blocks": 256, "prefix": "e2e:"}
    # A: a small CPU tier in front of Redis.
    kv_a = _kv([{"kind": "cpu", "blocks": 8}, redis_tier])
    a = engine.run_in_subprocess(
        {"model": str(tiny_llama), "kv_transfer_config": kv_a, "batches": one}
    )
    assert a["batches"][0]["outputs"] == want
    assert a["batches"][0]["num_cached_tokens"] == [0] + [SHARED] * (N_PROMPTS - 1)  # cold
    # A's blocks reached Redis while it ran: written through (the default below a volatile
    # tier) or demoted from its CPU tier.
    assert _stat(a, "redis", "stored") > 0

    # B: another process with other local tiers; it never saw these prompts.
    kv_b = _kv(
        [
            {"kind": "cpu", "blocks": 4},
            {"kind": "lmdb", "path": str(tmp_path / "lmdb-b"), "blocks": 8},
            redis_tier,
        ]
    )
    b = engine.run_in_subprocess(
        {"model": str(tiny_llama), "kv_transfer_config": kv_b, "batches": one}
    )
    (batch,) = b["batches"]
    assert batch["outputs"] == want  # identical outputs
    assert batch["num_cached_tokens"] == [192] * N_PROMPTS  # every full block from tiercache
    assert _stat(b, "redis", "hits") >= DISTINCT_BLOCKS  # ... found in the shared Redis tier
    assert _stat(b, "redis", "errors") == 0
    (store,) = b["stores"].values()
    assert store["counters"].get("load_error_blocks", 0) == 0
