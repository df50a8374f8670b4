"""Identical outputs under load and across a restart (issue 48; LMCache #4492's scenario).

`vllm serve` in its default multiprocess mode, fp32, temperature 0, an engine cache smaller
than the working set (``--num-gpu-blocks-override``), tiercache on CPU + NVMe (written
through: the persistent tier). 32 prompts, 8 prefixes of 7 blocks each shared by 4 prompts,
sent 16 at a time over HTTP:

1. The reference: the same prompts through an engine without a connector (in process, all
   at once, the same engine cache), started beside step 2's server: a third server start
   would add ~40 s on a loaded 2-core host. fp32 greedy outputs do not depend on batching
   (engine.py's DTYPE says why fp32).
2. With tiercache on a fresh store: every completion equals the reference's, 0 failures.
3. The same prompts again, and SIGTERM to the API server once a few of them have answered
   (vLLM's default ``--shutdown-timeout 0`` force-kills the engine core with stores in
   flight). Every answer equals the reference; one the shutdown ended (HTTP 200,
   finish_reason "abort", the tokens it had so far) is the reference's start. vLLM 0.32's API server
   then waits for its open connections to close although its engine is gone (the requests in
   flight hang until the client gives up), so once the engine core is killed the test kills
   what is left of the server, as a supervisor would.
4. A restart on the same store, the same prompts at concurrency 16: every completion equals
   the reference's, 0 failures, and the store serves at least every prefix once
   (``vllm:external_prefix_cache_hits`` on the server's /metrics: the connector's tokens;
   after a restart vLLM's own prefix cache is empty, so the first request of each prefix can
   only hit there).

Two server starts and one in-process engine, of a 2-layer model."""

from __future__ import annotations

import importlib.util
import random
import re
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from tests.openai_server_deps import skip_if_missing  # noqa: E402

skip_if_missing()  # vLLM 0.33's server needs orjson (tests/openai_server_deps.py)

ROOT = Path(__file__).resolve().parents[2]
# The serving bench's identity client (bench/serve_identity.py: stdlib only), which this test
# runs at CI's size.
_spec = importlib.util.spec_from_file_location(
    "serve_identity", ROOT / "bench" / "serve_identity.py"
)
assert _spec is not None and _spec.loader is not None
IDENTITY = importlib.util.module_from_spec(_spec)
sys.modules["serve_identity"] = IDENTITY  # its dataclasses look their module up there
_spec.loader.exec_module(IDENTITY)

BLOCK = 32
PREFIXES = 8
PER_PREFIX = 4
PREFIX_LEN = 7 * BLOCK
SUFFIX_LEN = 40  # one block of the prompt's own, then 8 tokens of a partial block
CONCURRENCY = 16
# 120 blocks of distinct prompt KV (8 x 7 prefix blocks, 32 x 2 own) against 48 in the
# engine: most of what the prompts share is evicted from vLLM's cache before it is reused.
ENGINE_BLOCKS = 48
ARGS = ["--num-gpu-blocks-override", str(ENGINE_BLOCKS), "--max-num-seqs", str(CONCURRENCY)]


def _prompts() -> list[list[int]]:
    rng = random.Random(48)
    prefixes = [[rng.randrange(3, 4096) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    prompts = [
        p + [rng.randrange(3, 4096) for _ in range(SUFFIX_LEN)]
        for p in prefixes
        for _ in range(PER_PREFIX)
    ]
    rng.shuffle(prompts)  # siblings spread over the run, as users' requests arrive
    return prompts


def _kv(root: Path) -> dict[str, Any]:
    tiers = [
        {"kind": "cpu", "capacity": "1MiB"},  # 32 blocks of 32 KiB: loads come from NVMe too
        {"kind": "nvme", "path": str(root / "nvme"), "capacity": "64MiB"},
    ]
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": {"tiers": tiers}},
    }


def _serve(srv: Any, prompts: list[list[int]], stop_after: int | None = None) -> Any:
    """Send every prompt, `CONCURRENCY` at a time, with the serving bench's client
    (bench/serve_identity.py's `run_pass`: each one's output ids, None where it failed, the
    failures, which answers came after the signal and which were aborted). With
    `stop_after`, SIGTERM the server once that many have answered."""
    return IDENTITY.run_pass(
        srv.url, srv.model, prompts, CONCURRENCY, 8, stop_after=stop_after,
        stop=lambda: _sigterm_mid_run(srv),
    )  # fmt: skip


def _sigterm_mid_run(srv: Any) -> None:
    """SIGTERM to the API server; once it has force-killed its engine core (its log says
    so, within 60 s), kill the rest of its group (the module docstring, step 3; the bench's
    `sigterm_mid_run`)."""
    assert IDENTITY.sigterm_mid_run(srv.proc, srv.log_text), srv.log_tail()


def _external_hits(metrics: str) -> float:
    """The connector's hit tokens since the server started (vLLM's counter)."""
    m = re.search(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert m, "vllm:external_prefix_cache_hits_total not in /metrics"
    return float(m.group(1))


def test_identical_outputs_under_load_and_across_a_restart(
    engine: ModuleType, server: ModuleType, tiny_llama: Path, tmp_path: Path
) -> None:
    prompts = _prompts()
    kv = _kv(tmp_path)
    t0 = time.monotonic()

    # 1. The reference: no connector, the same engine cache (in process, beside step 2).
    spec = {
        "model": str(tiny_llama),
        "num_gpu_blocks_override": ENGINE_BLOCKS,
        "batches": [{"prompts": prompts, "max_tokens": 8}],
    }
    ref_engine = engine.start_in_subprocess(spec)
    try:
        # 2. tiercache on a fresh store, under load.
        first = tmp_path / "first.log"
        with server.Server(tiny_llama, first, kv_transfer_config=kv, args=ARGS) as srv:
            srv.start()
            reference: list[list[int]] = ref_engine.result()["batches"][0]["outputs"]
            # A useful oracle only if different prompts give different tokens.
            assert len({tuple(o) for o in reference}) == len(prompts)
            got = _serve(srv, prompts)
            assert got.failures == []
            assert got.outputs == reference
            # 3. Again, and SIGTERM mid-run: requests in flight fail, stores may be torn.
            got = _serve(srv, prompts, stop_after=6)
            log = srv.log_text()
    finally:
        ref_engine.kill()
    assert "force killing" in log, log[-3000:]
    assert sum(o is not None for o in got.outputs) >= 6
    # A request the shutdown ended answers HTTP 200 with finish_reason "abort" and the tokens
    # it had so far (an empty list, in a run of this check by hand): it must be the start of
    # the reference (`Pass.mismatched`). A whole answer ("length") must equal it.
    wrong = [
        (i, i in got.aborted, i in got.after_signal, got.outputs[i], reference[i])
        for i in got.mismatched(reference)
    ]
    assert wrong == [], wrong  # (prompt, aborted, after the signal, output, reference)

    # 4. A restart on the same store: the same prompts under load.
    with server.Server(
        tiny_llama, tmp_path / "restart.log", kv_transfer_config=kv, args=ARGS
    ) as srv:
        srv.start()
        got = _serve(srv, prompts)
        hits = _external_hits(server.get(srv.url + "/metrics"))
        srv.sigterm()
    assert got.failures == [] and got.aborted == set()
    assert got.mismatched(reference) == []
    # Each prefix's first request after the restart can only hit in the store.
    loadable = len(prompts) * ((PREFIX_LEN + SUFFIX_LEN - 1) // BLOCK * BLOCK)
    print(
        f"external hit tokens after the restart: {hits:.0f} of {loadable} loadable; "
        f"{time.monotonic() - t0:.0f} s"
    )
    assert hits >= PREFIXES * PREFIX_LEN
