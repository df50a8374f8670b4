"""Issue 51 end to end: two `vllm serve` engines (multiprocess, one core each) on one shared
store, each publishing vLLM's KV events over ZMQ, and the test router (tests/kv_router.py)
subscribed to both. For every request, the router's predicted hit for the engine that serves
it (the longest prefix of the prompt's vLLM block hashes that engine reports in STORAGE,
capped where vLLM's lookup stops) must equal the tokens the engine loads from the store
(`cached_tokens`: vLLM's own prefix cache is off, so every cached token is loaded by
tiercache), within one block, whichever engine stored the prefix. The store holds fewer
blocks than the requests write, so both engines' writes keep evicting blocks the other one
stored: predictions follow what is really there. A second router started mid-run rebuilds
its view through the engines' replay endpoints and must agree with the live one.

The store, one test each: an LMDB store of CAP blocks (tiercache's own eviction, by whichever
engine writes), and a real redis-server with a small `maxmemory` (about CAP blocks) and
`allkeys-lru`, so Redis itself evicts (the engines' indexes are larger than that: neither
ever deletes a block) and the engines learn it only from their sweeps of the store.

CI runs the LMDB store on vLLM 0.32 and 0.33 (conftest's EVERY_VLLM). The Redis store is
marked `stress` (run by hand: `-m stress`): it passed 13 of its last 14 runs on 0.32 and
0.33 (the other lost a test port to another socket, since fixed in tests/ports.py; an earlier
session's failure, a marker block never reported, did not recur), and CI's time does not
allow it yet (docs/events.md). After each request both engines step first and the router is
asked after (an idle engine reports nothing, so asking first only idled, up to a second a
request); docs/events.md has the durations.

After each request the engine that served it stores a marker block, and both engines run
one-token requests (an engine publishes its events, and polls the shared store, only when it
steps: an idle engine reports at its next step) until both report the marker."""

from __future__ import annotations

import itertools
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
from tests.test_tier_redis import RedisServer, require_redis  # noqa: E402

BLOCK = 32
N_REQUESTS = 120
N_DOCS = 12  # shared prefixes of DOC_BLOCKS blocks
DOC_BLOCKS = 4
CAP = 40  # blocks the store holds: the requests write several times more
BLOCK_BYTES = 2 * 2 * 2 * 32 * BLOCK * 4  # K and V, 2 layers, 2 KV heads of 32, fp32
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


def _kv(tiers: list[dict[str, Any]]) -> dict[str, Any]:
    redis = tiers[0]["kind"] == "redis"
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        # Redis may evict a block between the lookup that found it and its load (its LRU is
        # approximate, and the load's own replies count against maxmemory): vLLM recomputes
        # it, where "fail" would fail the request; `_check` counts them.
        **({"kv_load_failure_policy": "recompute"} if redis else {}),
        "kv_connector_extra_config": {
            "config": {"namespace": "router-e2e", "tiers": tiers},
            "events_poll_s": 0,  # poll the store at every step
        },
    }


def _redis(root: Path) -> RedisServer:
    """A redis-server that evicts the least recently used keys past its `maxmemory`
    (`_cap_memory`)."""
    require_redis()
    return RedisServer(root, "--maxmemory-policy", "allkeys-lru")


def _cap_memory(srv: RedisServer) -> None:
    """Room for about CAP blocks (more while the engines' connections buffer less) over what
    the server uses once both engines are connected, plus the buffers of their pipelined
    reads and writes, which Redis counts too (without them it holds a few blocks)."""
    r = srv.client()
    try:
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory", used + CAP * (BLOCK_BYTES + 8192) + (2 << 20))
    finally:
        r.close()


@pytest.mark.parametrize("store", ["lmdb", pytest.param("redis", marks=pytest.mark.stress)])
def test_router_predicts_the_tokens_each_engine_loads(
    server: ModuleType, tiny_llama: Path, tmp_path: Path, store: str
) -> None:
    srv = _redis(tmp_path / "redis") if store == "redis" else None
    if srv is not None:  # an index larger than the server's memory: only Redis evicts
        redis = {"url": srv.url, "blocks": 16 * CAP, "prefix": "router:", "timeout": 10.0}
        tiers = [{"kind": "redis", **redis}]  # a long timeout: a test machine may be loaded
    else:
        tiers = [{"kind": "lmdb", "path": str(tmp_path / "lmdb"), "blocks": CAP}]
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
            kv_transfer_config=_kv(tiers),
            args=["--no-enable-prefix-caching", "--kv-events-config", json.dumps(events)],
            env={"VLLM_CPU_OMP_THREADS_BIND": str(i)},
        )
    pub = {e: f"tcp://127.0.0.1:{p}" for e, (p, _) in ports.items()}
    rep = {e: f"tcp://127.0.0.1:{r}" for e, (_, r) in ports.items()}
    rows: list[dict[str, Any]] = []
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once
            list(pool.map(lambda s: s.start(), servers.values()))
        if srv is not None:
            _cap_memory(srv)
        with KVRouter(pub, rep) as router:
            writer: dict[Any, str] = {}  # block hash -> engine that stored it first
            marks = random.Random(7)
            refused = 0  # markers Redis refused to store (`_settle`)
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
                        # leading blocks some engine stored before: those beyond the
                        # prediction were evicted since
                        "stored_before": sum(
                            1 for _ in itertools.takewhile(writer.__contains__, hashes[:cap])
                        )
                        * BLOCK,
                    }
                )
                for h in hashes:
                    writer.setdefault(h, e)
                refused += _settle(router, servers, e, marks, srv)
                if loaded != pred[e] * BLOCK:  # diagnosis: what the router has now
                    rows[-1]["after"] = {
                        x: router.predicted_hit_blocks(x, hashes, STORAGE) for x in "ab"
                    }
                if i == N_REQUESTS // 2:
                    _restarted_router_agrees(router, pub, rep)
        evicted = _evicted(srv)
    finally:
        for s in servers.values():
            s.kill()
        if srv is not None:
            srv.kill()
    logs = "".join((tmp_path / f"server-{e}.log").read_text(errors="replace") for e in "ab")
    failures = logs.count("Recovered from KV load failure")
    _check(rows, tmp_path, store, evicted, failures, refused)


def _evicted(srv: RedisServer | None) -> tuple[int, int] | None:
    """Keys the Redis server evicted, and keys it holds (None: not Redis)."""
    if srv is None:
        return None
    r = srv.client()
    try:
        return int(r.info("stats")["evicted_keys"]), int(r.dbsize())
    finally:
        r.close()


def _settle(router: KVRouter, servers: dict[str, Any], e: str, rng: random.Random, srv: Any) -> int:
    """Wait until both engines' views include everything up to now: engine `e` stores a
    marker block (a one-block prompt of its own), then both step (one-token requests) until
    both report the marker. Each engine's events are in order, and the other one reports the
    marker from a poll of the store that also swept it, so both are up to date.

    A marker that Redis refused to store (an OOM reply: past `maxmemory` its clients' buffers
    can leave nothing to evict) is never reported, by design: then, and only then, a new
    marker is stored. Returns how many markers Redis refused."""
    refused = 0
    for _ in range(3):
        oom = _ooms(srv)
        marker = [rng.randrange(3, 4096) for _ in range(BLOCK + 1)]
        servers[e].complete(marker, max_tokens=1)
        (h,) = vllm_block_hashes(marker, BLOCK)

        def both(h: Any = h) -> bool:
            return all(router.predicted_hit_blocks(x, [h], STORAGE) == 1 for x in "ab")

        for _ in range(300):  # an idle engine reports nothing: step both, then look
            for s in servers.values():
                s.complete([1], max_tokens=1)  # a step: events published, the store polled
            if router.wait(both, timeout=0.2):
                return refused
        reported = {x: router.predicted_hit_blocks(x, [h], STORAGE) for x in "ab"}
        if reported[e] == 0 and _ooms(srv) > oom:
            refused += 1
            continue
        stats = (router.stats("a"), router.stats("b"))
        raise AssertionError(("marker not reported", e, reported, stats, _redis_state(srv)))
    raise AssertionError(("Redis refused 3 markers in a row", e, _redis_state(srv)))


def _ooms(srv: RedisServer | None) -> int:
    """Commands the Redis server refused for want of memory (0: not Redis)."""
    if srv is None:
        return 0
    r = srv.client()
    try:
        return int(r.info("errorstats").get("errorstat_OOM", {}).get("count", 0))
    finally:
        r.close()


def _redis_state(srv: RedisServer | None) -> dict[str, Any] | None:
    """For a failure's message: what the Redis server holds and has evicted."""
    if srv is None:
        return None
    r = srv.client()
    try:
        mem, stats = r.info("memory"), r.info("stats")
        return {
            "keys": r.dbsize(),
            "evicted": stats["evicted_keys"],
            "used_memory": mem["used_memory"],
            "maxmemory": mem["maxmemory"],
            "clients": mem.get("mem_clients_normal"),
            "refused_oom": _ooms(srv),
        }
    finally:
        r.close()


def _restarted_router_agrees(live: KVRouter, pub: dict[str, str], rep: dict[str, str]) -> None:
    """A router started now rebuilds, from the engines' replay buffers, the live one's view."""
    with KVRouter(pub, rep) as late:
        for e in "ab":

            def same(e: str = e) -> bool:
                return late.held(e) == live.held(e)

            assert late.wait(same, timeout=60), (e, late.stats(e))


def _check(
    rows: list[dict[str, Any]],
    tmp_path: Path,
    store: str,
    evicted: tuple[int, int] | None,
    load_failures: int,
    markers_refused: int,
) -> None:
    diffs = [(r["loaded"] - r["predicted"]) // BLOCK for r in rows]
    summary = {
        "store": store,
        "vllm": vllm.__version__,
        "redis_evicted_and_held_keys": evicted,
        "load_failures_recomputed": load_failures,
        "markers_refused_oom": markers_refused,
        "requests": len(rows),
        "diff_blocks": dict(Counter(diffs)),
        "median_loaded": statistics.median(r["loaded"] for r in rows),
        "hits": sum(r["loaded"] > 0 for r in rows),
        "hits_stored_by_other": sum(r["stored_by_other"] and r["loaded"] > 0 for r in rows),
        "predicted_below_stored_before": sum(r["predicted"] < r["stored_before"] for r in rows),
    }
    (tmp_path / "summary.json").write_text(json.dumps({"summary": summary, "rows": rows}))
    print("router events:", json.dumps(summary))
    assert len(rows) >= 100
    bad = [r for r in rows if abs(r["loaded"] - r["predicted"]) > BLOCK]  # within one block
    assert not bad, (summary, bad[:5])
    # The store evicted: some prefixes were predicted (and loaded) only in part, and the
    # other engine's blocks were credited and loaded.
    assert summary["hits_stored_by_other"] > 0
    assert evicted is None or evicted[0] > 0  # Redis itself evicted
    assert any(0 < r["loaded"] < DOC_BLOCKS * BLOCK for r in rows) or any(
        r["loaded"] == 0 and r["i"] > N_DOCS for r in rows
    )
