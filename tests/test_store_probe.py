"""Read-only probes of shared stores (`Tier.open_probe`), what vLLM's scheduler asks when its
worker, and so its cache, runs in another process: a probe opened before anything was stored
finds what another process stored afterwards, reads only its own namespace's headers, writes
nothing, and answers 0 (soon) when the store cannot be reached."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from tests.campaign_children import churn
from tests.campaign_support import blocks, key, start_child
from tiercache import TierCache
from tiercache.config import CacheConfig
from tiercache.connectors.probes import open_probes, probe_chain
from tiercache.tiers import tier_class

BB = 4096


def _config(tiers: list[dict], namespace: str) -> CacheConfig:
    return CacheConfig.from_mapping({"namespace": namespace, "tiers": tiers})


def _files(path: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()}


def test_lmdb_probe_finds_what_another_process_stored_after_it_opened(tmp_path: Path) -> None:
    path = tmp_path / "store"
    lmdb = {"kind": "lmdb", "blocks": 64, "path": str(path)}
    ((_, probe),) = open_probes(_config([{"kind": "cpu", "blocks": 4}, lmdb], "fleet"), BB)
    other = tier_class("lmdb").open_probe(
        _config([lmdb], "tenant-b").tiers[0], BB, namespace="tenant-b"
    )
    assert other is not None
    try:
        chain = [key(i) for i in range(6)]
        assert probe.probe(chain) == 0  # no store yet: not an error
        # Another engine's process stores the first 4 blocks of the chain.
        assert start_child(churn, lmdb, BB, "fleet", list(range(4))).result(120) == {"errors": 0}
        probe._retry.until = 0.0  # type: ignore[attr-defined]  # the once-a-second retry, now
        before = _files(path)
        assert probe.probe(chain) == 4  # leading blocks only
        assert probe.probe(chain[1:]) == 3
        assert probe.probe([key(99), *chain]) == 0
        assert probe_chain([("lmdb", probe)], chain) == 4
        assert probe_chain([("lmdb", probe)], chain, off={"lmdb"}) == 0  # suspended
        # Another tenant's equal keys are not its blocks.
        other._retry.until = 0.0  # type: ignore[attr-defined]
        assert other.probe(chain) == 0
        # The store grows after the probe opened: found too.
        start_child(churn, lmdb, BB, "fleet", list(range(4, 6))).result(120)
        assert probe.probe(chain) == 6
        # Read-only: the data file is as the writer left it (lock.mdb holds reader slots).
        assert _files(path)["data.mdb"][0] == before["data.mdb"][0]
    finally:
        probe.close()
        other.close()
    assert probe.probe([key(0)]) == 0  # closed: nothing


def test_lmdb_probe_borrows_the_environment_of_a_tier_in_this_process(tmp_path: Path) -> None:
    # LMDB forbids a second open of one environment in a process: the probe shares it.
    config = {"namespace": "n", "tiers": [{"kind": "lmdb", "blocks": 16, "path": str(tmp_path)}]}
    cache = TierCache.open(config, block_bytes=BB)
    ((_, probe),) = open_probes(cache.config, BB)
    try:
        cache.put([key(1), key(2)], blocks([1, 2], BB))
        assert probe.probe([key(1), key(2), key(3)]) == 2
    finally:
        probe.close()
        cache.close()


def test_volatile_tiers_have_no_probe() -> None:
    cfg = _config([{"kind": "cpu", "blocks": 4}], "n")
    assert open_probes(cfg, BB) == []


def test_redis_probe_finds_later_stores_and_answers_soon_when_the_server_hangs() -> None:
    from tests.test_tier_redis import RedisServer, require_redis

    require_redis()  # a skip where redis-server is missing; under CI=true a failure

    d = Path(tempfile.mkdtemp(prefix="tc-probe-"))
    srv = RedisServer(d, "--appendonly", "no")
    prefix = f"tc-probe:{os.getpid()}:"
    redis = {"kind": "redis", "url": srv.url, "blocks": 64, "prefix": prefix, "timeout": 0.3}
    cfg = _config([{"kind": "cpu", "blocks": 4}, redis], "fleet")
    try:
        ((_, probe),) = open_probes(cfg, BB)
        chain = [key(i) for i in range(5)]
        assert probe.probe(chain) == 0
        keys_before = srv.client().dbsize()
        assert keys_before == 0  # opening the probe wrote nothing (no metadata, no blocks)
        writer = TierCache.open(
            {"namespace": "fleet", "tiers": [redis]}, block_bytes=BB
        )  # another engine
        try:
            writer.put(chain[:3], blocks(range(3), BB))
            writer.flush()
        finally:
            writer.close()
        assert probe.probe(chain) == 3
        other = tier_class("redis").open_probe(cfg.tiers[1], BB, namespace="tenant-b")
        assert other is not None and other.probe(chain) == 0
        other.close()
        # A hung server: the first probe waits at most its timeout, then the back-off
        # answers 0 at once; nothing raises.
        srv.pause()
        try:
            t0 = time.monotonic()
            assert probe.probe(chain) == 0
            assert probe.probe(chain) == 0
            assert time.monotonic() - t0 < 5.0  # bounded by timeout (0.3 s), not hung
        finally:
            srv.resume()
        probe.close()
    finally:
        srv.kill()
        shutil.rmtree(d, ignore_errors=True)
