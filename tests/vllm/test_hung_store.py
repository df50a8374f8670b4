"""A hung disk under stores (issue 16): vLLM gets the blocks of a store that misses its
`[deadlines] store_timeout` back, so later requests still find room, and outputs stay equal to
an engine without tiercache.

The engine (in-process, so the test can hang its NVMe tier's writes) has 40 KV cache blocks.
The first batch's 6 requests need 24 of them; vLLM keeps a finished request's blocks until
its stores report done. With every NVMe write hung, those stores never finish: without the
deadline the second batch (6 more requests, 24 blocks) could never get room, and the engine
would wait for ever. With it, each store is given up after 1 s (it reads no more engine
blocks), the tier is suspended, and the second batch runs. Once the disk comes back and the
back-off ends, stores resume and a repeated batch hits.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm")

PROMPT_TOKENS = 100  # 3 full 32-token blocks; with 8 new tokens, 4 blocks per request
BACKOFF_S = 2.0
STORE_TIMEOUT_S = 1.0  # the offloading spec case's [deadlines] store_timeout
# _WAIT_SERVING: the batch after the disk is back waits until no tier is suspended, not for
# BACKOFF_S. The suspension is BACKOFF_S only if the tier tripped once: a hung copy still
# running when that period ends trips it again for twice as long (the breaker's back-off
# doubles while the tier has not served in between). Under load the batches take longer and
# that second trip comes before the release: the batch after a fixed BACKOFF_S wait then
# found the disk suspended for 1.6 s more, its stores could not go below the 4-block CPU
# tier, and the last batch hit 1 request of 6 (`suspended_s` in the batch facts shows it).


def _batch_facts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per batch, what says why it hit or missed: its hits, wall time, and what the engine
    recorded before it started (`suspended_s`, `waited_s`)."""
    keys = ("num_cached_tokens", "wall_s", "suspended_s", "waited_s")
    return [{k: b[k] for k in keys if k in b} for b in result["batches"]]


def _counter(result: dict[str, Any], name: str) -> int:
    return sum(int(s["counters"].get(name, 0)) for s in result["stores"].values())


@pytest.fixture(scope="module")
def prompts(engine: ModuleType) -> tuple[list[list[int]], list[list[int]]]:
    """The first and second prompt sets every test here sends (6 requests each)."""
    return engine.make_prompts(6, PROMPT_TOKENS, seed=44), engine.make_prompts(
        6, PROMPT_TOKENS, seed=45
    )


@pytest.fixture(scope="module")
def want(
    engine: ModuleType, tiny_llama: Path, prompts: tuple[list[list[int]], list[list[int]]]
) -> tuple[list[list[int]], list[list[int]]]:
    """Both sets' outputs from one engine without tiercache (8 tokens; fp32 greedy outputs do
    not depend on the batch or on vLLM's own prefix-cache hits), shared by the tests."""
    spec = {
        "model": str(tiny_llama),
        "num_gpu_blocks_override": 40,
        "batches": [{"prompts": p, "max_tokens": 8} for p in prompts],
    }
    first, second = (b["outputs"] for b in engine.run_in_subprocess(spec)["batches"])
    return first, second


def test_a_hung_store_gives_vllm_its_blocks_back(
    engine: ModuleType,
    tiny_llama: Path,
    tmp_path: Path,
    prompts: tuple[list[list[int]], list[list[int]]],
    want: tuple[list[list[int]], list[list[int]]],
) -> None:
    first, second = prompts
    release = tmp_path / "disk-back"
    batches = [
        {"prompts": first, "max_tokens": 8},
        {"prompts": second, "max_tokens": 8, "touch": str(release)},
        # The disk is back; the first set is stored once the back-off has ended ...
        {"prompts": first, "max_tokens": 8, "reset_prefix_cache": True},
        # ... and hits.
        {"prompts": first, "max_tokens": 8, "reset_prefix_cache": True},
    ]
    common = {"model": str(tiny_llama), "num_gpu_blocks_override": 40, "settle": True}
    kv = engine.tiercache_kv(
        {
            "namespace": "hung-store",
            "tiers": [{"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 256}],
            "deadlines": {"store_timeout": 1.0, "backoff": BACKOFF_S},
        }
    )
    # Batch 3 starts once the back-off has ended (`_WAIT_SERVING`), however long it is, and
    # once batch 1's given-up stores have ended in the transfer engine ("wait_writes"). A
    # given-up store keeps its keys reserved in the manager (stored, not yet ready) until
    # its job ends and is drained; the stores of those keys are skipped meanwhile
    # (`prepare_store` takes only keys no tier holds: `store_skipped_blocks`). After the
    # disk comes back, the transfer engine's thread still works through the hung backlog;
    # a batch started before it is done (once 0.75 s after the release) skipped 9 blocks,
    # and batch 4 hit 2 of 6. Once the jobs have ended, batch 3's lookups drain them
    # (`KVWorker._settle`, as a chain stops at a reserved key) before its stores are planned.
    # (This was the "not yet understood" BACKOFF_S pause: a guess at how long that takes.)
    batches[2]["wait_writes"] = True
    batches[2]["wait_serving"] = True
    assert not release.exists()
    got = engine.run_in_subprocess(
        {**common, "batches": batches, "kv_transfer_config": kv, "hang_writes": str(release)},
        timeout=300,
    )
    print(json.dumps({"batches": _batch_facts(got), "stores": got["stores"]}, default=str))
    assert [b["outputs"] for b in got["batches"]] == [want[0], want[1], want[0], want[0]]
    # Batch 1's stores were given up (18 full blocks, the first of each maybe read already),
    # batch 2 found the tier suspended and stored nothing; the wall time of batch 2 is far
    # below "for ever" (the deadline is 1 s).
    assert _counter(got, "store_deadline_blocks") > 0
    assert got["batches"][1]["wall_s"] < 60
    (stats,) = (s["stats"] for s in got["stores"].values())
    assert stats["nvme"]["suspensions"] >= 1
    # Back: batch 3 stored the first set, batch 4 hit all of it.
    assert got["batches"][3]["num_cached_tokens"] == [96] * 6


def test_an_engine_exits_while_its_disk_is_hung(
    engine: ModuleType,
    tiny_llama: Path,
    tmp_path: Path,
    prompts: tuple[list[list[int]], list[list[int]]],
    want: tuple[list[list[int]], list[list[int]]],
) -> None:
    """At shutdown the connector waits for hung stores at most `store_timeout`, suspends the
    tier (the cache's close writes nothing back into it) and leaves them behind: the engine
    process ends, with its outputs, instead of waiting for the disk."""
    batches = [{"prompts": prompts[0][:2], "max_tokens": 4}]
    kv = engine.tiercache_kv(
        {
            "namespace": "hung-exit",
            "tiers": [
                {"kind": "cpu", "blocks": 64},
                {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 64},
            ],
            "deadlines": {"store_timeout": 1.0},
        }
    )
    never = tmp_path / "never"  # the disk never comes back
    got = engine.run_in_subprocess(
        {
            "model": str(tiny_llama),
            "batches": batches,
            "kv_transfer_config": kv,
            "hang_writes": str(never),
        },
        timeout=120,  # the hung write itself waits 300 s
    )
    # Greedy: the first 4 tokens of the 8 the baseline generated.
    assert got["batches"][0]["outputs"] == [o[:4] for o in want[0][:2]]
    assert not never.exists()


# -- TierCacheOffloadingSpec under vLLM's own OffloadingConnector ------------------------------
@pytest.mark.parametrize("tiers", ["nvme", "cpu+nvme", "cpu+nvme-write-back"])
def test_a_hung_store_gives_vllm_its_blocks_back_through_the_offloading_spec(
    engine: ModuleType,
    tiny_llama: Path,
    tmp_path: Path,
    tiers: str,
    prompts: tuple[list[list[int]], list[list[int]]],
    want: tuple[list[list[int]], list[list[int]]],
) -> None:
    """The same through vLLM's OffloadingConnector, which holds a finished request's blocks
    until the spec's worker reports its store job done. `nvme`: the store itself writes into
    the hung disk; it is given up at `store_timeout` (no engine block read after that) and
    the job reported done, its blocks misses. `cpu+nvme` (a CPU tier of 4 blocks): the stores
    land in memory and the write-through thread hangs on the disk (the tier is suspended at
    `store_timeout`). `cpu+nvme-write-back`: the stores demote older blocks into the hung
    disk, or go around the full CPU tier into it; vLLM's job stops waiting for either at
    `store_timeout` (a move alone: `test_offloading_spec.py`'s unit test)."""
    first, second = prompts
    release = tmp_path / "disk-back"
    batches = [
        {"prompts": first, "max_tokens": 8},
        # vLLM's prefix cache is reset before batch 3: vLLM's OffloadingConnector stores only
        # the blocks a request computes, so first-set blocks still cached by vLLM would not
        # be offered again (those whose stores were given up are lost, as documented).
        # Once the newest hung write has hung longer than store_timeout: a hung write-through
        # copy, which vLLM's job never waits for, is then past its deadline too when batch 2
        # starts (a condition: a fixed pause fell short when the copy started late).
        {
            "prompts": second,
            "max_tokens": 8,
            "touch": str(release),
            "reset_prefix_cache": True,
            "wait_hung_s": STORE_TIMEOUT_S + 0.1,
        },
        {"prompts": first, "max_tokens": 8, "reset_prefix_cache": True},
        {"prompts": first, "max_tokens": 8, "reset_prefix_cache": True},
    ]
    common = {"model": str(tiny_llama), "num_gpu_blocks_override": 40, "settle": True}
    nvme = {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 256}
    if tiers.endswith("write-back"):
        nvme["write_policy"] = "write-back"
    config = {
        "namespace": f"hung-store-spec-{tiers}",
        "tiers": [nvme] if tiers == "nvme" else [{"kind": "cpu", "blocks": 4}, nvme],
        "deadlines": {"store_timeout": STORE_TIMEOUT_S, "backoff": BACKOFF_S},
    }
    batches[2]["wait_serving"] = True  # once the back-off has ended (`_WAIT_SERVING`)
    # ... and once batch 1's given-up stores have ended in the transfer engine, as the KV
    # connector's case above waits (`wait_writes`: a given-up store's keys stay reserved
    # until then). Without it, once under load (the vLLM stage beside a serving bench),
    # batch 3 started while the hung backlog was still being written after the release: the
    # 12 blocks whose given-up stores were still reserved were not stored again (those stores
    # then ended failed: offload_store_failures 12), and batch 4 hit 2 of 6 (nvme).
    batches[2]["wait_writes"] = True
    got = engine.run_in_subprocess(
        {
            **common,
            "batches": batches,
            "kv_transfer_config": engine.offloading_kv(config),
            "hang_writes": str(release),
        },
        timeout=300,
    )
    assert [b["outputs"] for b in got["batches"]] == [want[0], want[1], want[0], want[0]]
    assert got["batches"][1]["wall_s"] < 60
    (store,) = got["stores"].values()
    # On a failure, pytest shows what the engine's store counted (suspensions, drops, ...).
    print(json.dumps({"batches": _batch_facts(got), "store": store}, default=str))
    assert store["stats"]["nvme"]["suspensions"] >= 1
    if tiers == "nvme":
        assert store["counters"]["offload_store_deadline_blocks"] > 0
    elif tiers == "cpu+nvme-write-back":  # stores that went around the full CPU tier, moves
        c = store["counters"]
        assert c.get("offload_store_deadline_blocks", 0) + c.get("offload_move_deadline_blocks", 0)
    # Back: batch 3 stored the first set again, batch 4 hit all of it.
    assert got["batches"][3]["num_cached_tokens"] == [96] * 6
