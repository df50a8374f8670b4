"""Keys carry everything that changes KV values (issue 14, item 4), on a real vLLM CPU
engine: a store written by an engine without overrides serves nothing to an engine whose
`hf_overrides` change the rope (its KV differs), and that engine's outputs equal a run
without the connector with the same override; an engine without the override still hits."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm")

ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}


def _kv(root: Path) -> dict[str, Any]:
    tiers = [
        {"kind": "cpu", "blocks": 64},
        {"kind": "nvme", "path": str(root / "nvme"), "blocks": 256},
    ]
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": {"namespace": "identity", "tiers": tiers}},
    }


def test_an_override_that_changes_kv_never_hits_another_engines_store(
    engine: ModuleType, tiny_llama: Path, tmp_path: Path
) -> None:
    prompts = engine.make_prompts(6, 200, seed=23)  # distinct: vLLM's own cache gives none
    one = [{"prompts": prompts, "max_tokens": 12}]
    spec = {"model": str(tiny_llama), "batches": one}
    kv = _kv(tmp_path)
    wrote = engine.run_in_subprocess({**spec, "kv_transfer_config": kv})
    plain = wrote["batches"][0]["outputs"]
    want = engine.run_in_subprocess({**spec, "hf_overrides": ROPE})["batches"][0]["outputs"]
    assert want != plain  # the override changes the model's outputs (and so its KV)
    got = engine.run_in_subprocess({**spec, "kv_transfer_config": kv, "hf_overrides": ROPE})
    (batch,) = got["batches"]
    # Before: 1,216 of 1,216 loadable tokens came from the other engine's store, and the
    # outputs differed from `want`.
    assert batch["num_cached_tokens"] == [0] * len(prompts)
    assert batch["outputs"] == want
    control = engine.run_in_subprocess({**spec, "kv_transfer_config": kv})
    (batch,) = control["batches"]
    assert batch["num_cached_tokens"] == [192] * len(prompts)  # 6 full blocks each
    assert batch["outputs"] == plain
