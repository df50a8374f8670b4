"""Issue 51 end to end: two `vllm serve` engines (multiprocess, one core each) on one LMDB
store, each publishing vLLM's KV events over ZMQ, and the test router (tests/kv_router.py)
subscribed to both. For every request, the router's predicted hit for the engine that serves
it (the longest prefix of the prompt's vLLM block hashes that engine reports in STORAGE,
capped where vLLM's lookup stops) must equal the tokens the engine loads from the store
(`cached_tokens`: vLLM's own prefix cache is off, so every cached token is loaded by
tiercache), within one block, whichever engine stored the prefix. The store holds fewer
blocks than the requests write, so both engines' writes keep evicting blocks the other one
stored: predictions follow what is really there. A second router started mid-run rebuilds
its view through the engines' replay endpoints and must agree with the live one.

After each request the engine that served it stores a marker block, and both engines run
one-token requests (an engine publishes its events, and polls the shared store, only when it
steps: an idle engine reports at its next step) until both report the marker."""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from tests.openai_server_deps import skip_if_missing  # noqa: E402

skip_if_missing()  # vLLM 0.33's server needs orjson (tests/openai_server_deps.py)

from tests.kv_router import KVRouter, vllm_block_hashes  # noqa: E402

BLOCK = 32
N_REQUESTS = 120
N_DOCS = 12  # shared prefixes of DOC_BLOCKS blocks
DOC_BLOCKS = 4
CAP = 40  # blocks the LMDB store holds: the requests write several times more
STORAGE = {"STORAGE"}


def _requests(seed: int) -> list[tuple[str, list[int]]]:
    """(engine, prompt): a shared document prefix and a suffix of its own (20-80 tokens)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 4096) for _ in range(DOC_BLOCKS * BLOCK)] for _ in range(N_DOCS)]
    out = []
    for _ in range(N_REQUESTS):
        suffix = [rng.randrange(3, 4096) for _ in range(rng.randrange(20, 80))]
        out.append((rng.choice("ab"), rng.choice(docs) + suffix))
    return out


def _kv(root: Path) -> dict[str, Any]:
    tiers = [{"kind": "lmdb", "path": str(root / "lmdb"), "blocks": CAP}]
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "config": {"namespace": "router-e2e", "tiers": tiers},
            "events_poll_s": 0,  # poll the store at every step
        },
    }


def test_router_predicts_the_tokens_each_engine_loads(
    server: ModuleType, tiny_llama: Path, tmp_path: Path
) -> None:
    ports = {e: (server.free_port(), server.free_port()) for e in "ab"}
    servers = {}
    for i, e in enumerate("ab"):
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{ports[e][0]}",
            "replay_endpoint": f"tcp://*:{ports[e][1]}",
        }
        servers[e] = server.Server(
            tiny_llama,
            tmp_path / f"server-{e}.log",
            kv_transfer_config=_kv(tmp_path),
            args=["--no-enable-prefix-caching", "--kv-events-config", json.dumps(events)],
            env={"VLLM_CPU_OMP_THREADS_BIND": str(i)},
        )
    pub = {e: f"tcp://127.0.0.1:{p}" for e, (p, _) in ports.items()}
    rep = {e: f"tcp://127.0.0.1:{r}" for e, (_, r) in ports.items()}
    rows: list[dict[str, Any]] = []
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once
            list(pool.map(lambda s: s.start(), servers.values()))
        with KVRouter(pub, rep) as router:
            writer: dict[Any, str] = {}  # block hash -> engine that stored it first
            marks = random.Random(7)
            for i, (e, prompt) in enumerate(_requests(seed=51)):
                hashes = vllm_block_hashes(prompt, BLOCK)
                cap = (len(prompt) - 1) // BLOCK  # vLLM never loads the last token's block
                pred = {x: min(router.predicted_hit_blocks(x, hashes, STORAGE), cap) for x in "ab"}
                out = servers[e].complete(prompt, max_tokens=2)
                loaded = int(out["usage"]["prompt_tokens_details"]["cached_tokens"])
                other = pred["b" if e == "a" else "a"]
                rows.append(
                    {
                        "i": i,
                        "engine": e,
                        "predicted": pred[e] * BLOCK,
                        "loaded": loaded,
                        "other": other * BLOCK,
                        "stored_by_other": any(writer.get(h, e) != e for h in hashes[: pred[e]]),
                    }
                )
                for h in hashes:
                    writer.setdefault(h, e)
                _settle(router, servers, e, marks)
                if loaded != pred[e] * BLOCK:  # diagnosis: what the router has now
                    rows[-1]["after"] = {
                        x: router.predicted_hit_blocks(x, hashes, STORAGE) for x in "ab"
                    }
                if i == N_REQUESTS // 2:
                    _restarted_router_agrees(router, pub, rep)
    finally:
        for s in servers.values():
            s.kill()
    _check(rows, tmp_path)


def _settle(router: KVRouter, servers: dict[str, Any], e: str, rng: random.Random) -> None:
    """Wait until both engines' views include everything up to now: engine `e` stores a
    marker block (a one-block prompt of its own), then both step (one-token requests) until
    both report the marker. Each engine's events are in order, and the other one reports the
    marker from a poll of the store that also swept it, so both are up to date."""
    marker = [rng.randrange(3, 4096) for _ in range(BLOCK + 1)]
    servers[e].complete(marker, max_tokens=1)
    (h,) = vllm_block_hashes(marker, BLOCK)

    def both() -> bool:
        return all(router.predicted_hit_blocks(x, [h], STORAGE) == 1 for x in "ab")

    for _ in range(60):
        if router.wait(both, timeout=1.0):
            return
        for s in servers.values():
            s.complete([1], max_tokens=1)  # a step: events published, the store polled
    raise AssertionError(("marker not reported", e, router.stats("a"), router.stats("b")))


def _restarted_router_agrees(live: KVRouter, pub: dict[str, str], rep: dict[str, str]) -> None:
    """A router started now rebuilds, from the engines' replay buffers, the live one's view."""
    with KVRouter(pub, rep) as late:
        for e in "ab":

            def same(e: str = e) -> bool:
                return late.held(e) == live.held(e)

            assert late.wait(same, timeout=60), (e, late.stats(e))


def _check(rows: list[dict[str, Any]], tmp_path: Path) -> None:
    diffs = [(r["loaded"] - r["predicted"]) // BLOCK for r in rows]
    summary = {
        "requests": len(rows),
        "diff_blocks": dict(Counter(diffs)),
        "median_loaded": statistics.median(r["loaded"] for r in rows),
        "hits": sum(r["loaded"] > 0 for r in rows),
        "hits_stored_by_other": sum(r["stored_by_other"] and r["loaded"] > 0 for r in rows),
    }
    (tmp_path / "summary.json").write_text(json.dumps({"summary": summary, "rows": rows}))
    print("router events:", json.dumps(summary))
    assert len(rows) >= 100
    bad = [r for r in rows if abs(r["loaded"] - r["predicted"]) > BLOCK]  # within one block
    assert not bad, (summary, bad[:5])
    # The store evicted: some prefixes were predicted (and loaded) only in part, and the
    # other engine's blocks were credited and loaded.
    assert summary["hits_stored_by_other"] > 0
    assert any(0 < r["loaded"] < DOC_BLOCKS * BLOCK for r in rows) or any(
        r["loaded"] == 0 and r["i"] > N_DOCS for r in rows
    )
