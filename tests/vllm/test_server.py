"""`vllm serve` as users run it (issue 23): vLLM's OpenAI-compatible server in its default
multiprocess mode, over HTTP, tiercache configured by a TOML path (cpu 64 MiB, NVMe, LMDB,
`[telemetry]` with Prometheus), stopped with SIGTERM sent to the API server process.

Under vLLM's default ``--shutdown-timeout 0`` the API server force-kills the engine core and
its worker: tiercache's exit hook never runs, so only write-through (on by default for NVMe,
a persistent tier right below the volatile CPU tier) has put blocks on disk. With
``--shutdown-timeout 30`` the worker exits gracefully and closes the cache. Either way a
restarted server must hit (``usage.prompt_tokens_details.cached_tokens``) the full blocks of
the prompts it served before that the stores hold (after a graceful stop: all of them; after
a force kill: exactly those the stores held, read offline by key), with identical outputs.

Three server starts (~15-40 s each), one after the other on the same store."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from tests.openai_server_deps import skip_if_missing  # noqa: E402
from tiercache.hashing import prefix_hashes, shard_keys  # noqa: E402
from tiercache.tiers.format import namespace_id  # noqa: E402
from tiercache.tiers.lmdb import LMDBTier  # noqa: E402
from tiercache.tiers.nvme import NVMeTier  # noqa: E402

skip_if_missing()  # vLLM 0.33's server needs orjson (tests/openai_server_deps.py)

BLOCK = 32


def _prompts(n: int, seed: int) -> list[list[int]]:
    # 300-400 tokens, nothing shared: after a restart vLLM's own prefix cache gives nothing,
    # so `cached_tokens` counts tiercache's hits only.
    rng = random.Random(seed)
    return [[rng.randrange(3, 4096) for _ in range(rng.randrange(300, 400))] for _ in range(n)]


def _loadable(prompts: list[list[int]]) -> int:
    """Tokens in full blocks, but never the block holding the last prompt token."""
    return sum((len(p) - 1) // BLOCK * BLOCK for p in prompts)


def _on_disk(root: Path, namespace: str) -> set[bytes]:
    """Keys of the good blocks of `namespace` in the NVMe and LMDB stores, read offline as
    `tiercache inspect` reads them."""
    ns = namespace_id(namespace)
    held: set[bytes] = set()
    for tier, path in ((NVMeTier, root / "nvme"), (LMDBTier, root / "lmdb")):
        blocks = tier.offline_store(str(path), tier.kind).blocks()
        held |= {b.key for b in blocks if b.namespace == ns}
    return held


def _hittable(prompts: list[list[int]], namespace: str, held: set[bytes]) -> int:
    """Tokens a server can load for `prompts` from blocks with `held` keys: per prompt, its
    leading loadable blocks (the connector's keys) that are held; with head shards (the
    namespace's layout ends in "/heads:N") a block is held when each of its N shards is."""
    m = re.search(r"/heads:(\d+)", namespace)
    shards = range(int(m.group(1))) if m else None

    def whole(k: bytes) -> bool:
        return k in held if shards is None else held.issuperset(shard_keys([k], shards))

    n = 0
    for p in prompts:
        limit = (len(p) - 1) // BLOCK
        keys = prefix_hashes(p[: limit * BLOCK], BLOCK, namespace=namespace)
        n += BLOCK * next((j for j, k in enumerate(keys) if not whole(k)), len(keys))
    return n


def _write_config(root: Path, prometheus_port: int) -> Path:
    toml = f"""\
[[tiers]]
kind = "cpu"
capacity = "64MiB"

[[tiers]]
kind = "nvme"
path = "{root / "nvme"}"
capacity = "256MiB"

[[tiers]]
kind = "lmdb"
path = "{root / "lmdb"}"
capacity = "256MiB"

[telemetry]
dir = "{root / "telemetry"}"
interval = 0.5
prometheus = "127.0.0.1:{prometheus_port}"
"""
    path = root / "tiercache.toml"
    path.write_text(toml)
    return path


def _kv(config: Path) -> dict[str, Any]:
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": str(config)},
    }


def _serve(srv: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Send the prompts one by one; their output token ids and cached prompt tokens."""
    outputs, cached = [], []
    for p in prompts:
        r = srv.complete(p, max_tokens=16)
        outputs.append(r["choices"][0]["token_ids"])
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    return outputs, cached


def _stats(config: Path) -> dict[str, Any]:
    """`tiercache stats CONFIG --json`, as a user would run it beside the server."""
    proc = subprocess.run(
        [sys.executable, "-m", "tiercache", "stats", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def _metric(text: str, name: str, tier: str) -> float:
    m = re.search(rf'^{name}{{tier="{tier}"}} (\S+)$', text, re.M)
    assert m, f"{name}{{tier={tier!r}}} not in the exposition"
    return float(m.group(1))


def test_a_restarted_server_hits_what_it_served_before_sigterm(
    server: ModuleType, tiny_llama: Path, tmp_path: Path
) -> None:
    prom = server.free_port()
    config = _write_config(tmp_path, prom)
    kv = _kv(config)
    first, second, third = _prompts(8, seed=23), _prompts(4, seed=24), _prompts(4, seed=25)
    hit: dict[str, tuple[int, int]] = {}  # step -> (tokens hit, loadable tokens)

    # 1. A fresh store, vLLM's default flags. Nothing hits.
    with server.Server(tiny_llama, tmp_path / "server-1.log", kv_transfer_config=kv) as srv:
        srv.start()
        out_first, cached = _serve(srv, first)
        assert cached == [0] * len(first)
        # The running server's counters, from its Prometheus endpoint and `tiercache stats`.
        metrics = server.get(f"http://127.0.0.1:{prom}/metrics")
        stats = _stats(config)
        assert stats["state"] == "running", stats
        cpu_blocks = stats["tiers"]["cpu"]["used_blocks"]
        assert cpu_blocks >= _loadable(first) // BLOCK, stats["tiers"]["cpu"]
        assert _metric(metrics, "tiercache_tier_used_blocks", "cpu") >= 1
        assert "tiercache_tier_written_through_total" in metrics
        # 2. More prompts, then SIGTERM right after the last response: no pause for the
        # write-through thread to catch up.
        out_second, cached = _serve(srv, second)
        assert cached == [0] * len(second)
        srv.sigterm()
        log = srv.log_text()
    # The default --shutdown-timeout 0: the API server force-kills the engine core and its
    # worker. Whether the worker gets to close the cache first (it starts to when its parent
    # dies) is a race; write-through makes the restart below not depend on it.
    assert "force killing" in log, log[-3000:]
    stats = _stats(config)
    assert stats["state"] in ("dead", "closed"), stats
    nvme = stats["tiers"]["nvme"]  # the last snapshot the worker wrote
    assert nvme["written_through"] > 0 and nvme["through_dropped"] == 0, nvme
    # What the force kill left on disk, block by block: what the restart can hit, exactly.
    on_disk = _hittable(first + second, stats["namespace"], _on_disk(tmp_path, stats["namespace"]))

    # 3. Restart with --shutdown-timeout 30: everything served before hits, same outputs.
    graceful = ["--shutdown-timeout", "30"]
    log2 = tmp_path / "server-2.log"
    with server.Server(tiny_llama, log2, kv_transfer_config=kv, args=graceful) as srv:
        srv.start()
        outputs, cached = _serve(srv, first + second)
        assert outputs == out_first + out_second
        hit["after SIGTERM, default timeout"] = (sum(cached), _loadable(first + second))
        hit["on disk after the force kill"] = (on_disk, _loadable(first + second))
        out_third, cached = _serve(srv, third)
        assert cached == [0] * len(third)
        srv.sigterm()
        log = srv.log_text()
    # A graceful stop: the worker closed the cache.
    assert "force killing" not in log, log[-3000:]
    stats = _stats(config)
    assert stats["state"] == "closed", stats

    # 4. Restart with the default flags: what the gracefully stopped server stored hits.
    with server.Server(tiny_llama, tmp_path / "server-3.log", kv_transfer_config=kv) as srv:
        srv.start()
        outputs, cached = _serve(srv, third)
        assert outputs == out_third
        hit["after SIGTERM, --shutdown-timeout 30"] = (sum(cached), _loadable(third))
        srv.sigterm()

    print("tokens hit / loadable:", hit)
    # A graceful stop closed the cache (its write-through copies ran, then the write-back):
    # every loadable token hits, exactly.
    n, full = hit["after SIGTERM, --shutdown-timeout 30"]
    assert n == full, hit
    # A force kill races the write-through thread: the blocks it had not copied yet when
    # the engine died are lost by design (volatile CPU tier). The restart hits exactly what
    # the stores held after the kill, read block by block with the connector's keys.
    n, full = hit["after SIGTERM, default timeout"]
    assert n == on_disk <= full, hit
