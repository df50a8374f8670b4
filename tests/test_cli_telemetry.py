"""Telemetry of a running engine (`[telemetry]`) and the commands that read it: `tiercache
stats` (stats file, Prometheus endpoint, or a store on disk) and `tiercache events`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.polling import wait_until
from tiercache import CacheConfig, ConfigError, TierCache
from tiercache.cli import main
from tiercache.connectors.ranks import resolve_rank_config
from tiercache.telemetry import EVENTS_FILE, read_events, read_stats

BB = 4096


def config(tmp: Path, **telemetry: object) -> dict:
    return {
        "namespace": "tel",
        "tiers": [
            {"kind": "cpu", "blocks": 8},
            {"kind": "nvme", "blocks": 16, "path": str(tmp / "nvme"), "direct": False},
        ],
        "telemetry": {"dir": str(tmp / "tel"), "interval": 0.05, **telemetry},
    }


def write_toml(tmp: Path, **telemetry: object) -> Path:
    tel = {"dir": str(tmp / "tel"), "interval": 0.05, **telemetry}
    p = tmp / "c.toml"
    p.write_text(
        'namespace = "tel"\n[[tiers]]\nkind = "cpu"\nblocks = 8\n'
        f'[[tiers]]\nkind = "nvme"\nblocks = 16\npath = "{tmp / "nvme"}"\ndirect = false\n'
        "[telemetry]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in tel.items())
    )
    return p


def work(cache: TierCache, rounds: int, start: int = 0) -> None:
    """Puts and gets of distinct 2-block chains: stores, hits, evictions, demotions."""
    for i in range(start, start + rounds):
        keys = cache.hash_tokens(list(range(i * 1000, i * 1000 + 32)))
        cache.put(keys, torch.full((2, BB), i % 251, dtype=torch.uint8))
        cache.get(keys)
    cache.flush()  # the write-through copies queued by the puts have landed


# The counters the tests compare between a cache and what its telemetry shows.
COUNTERS = ("hits", "misses", "stored", "evictions", "errors", "used_blocks", "capacity_blocks")


def run(*args: str) -> object:
    return CliRunner().invoke(main, [*args])


ENGINE = """
import json, os, sys, time, torch
from tiercache import TierCache
sys.path.insert(0, sys.argv[2])
from test_cli_telemetry import COUNTERS, work
cache = TierCache.open(sys.argv[1], block_bytes=4096)
work(cache, 30)
live = cache.stats()
print(json.dumps(live), flush=True)
# "ready" once the stats file shows these counters (a telemetry write after the work), or
# "not shown" after 120 s (a loaded machine): the tests compare the file against them.
from tiercache.telemetry import read_stats
def shown():
    try:
        tiers = read_stats(cache.config.telemetry.dir)["tiers"]
    except ValueError:
        return False
    return all(tiers[t][c] == live[t][c] for t in live for c in COUNTERS)
deadline = time.monotonic() + 120
while not (ok := shown()) and time.monotonic() < deadline:
    time.sleep(0.01)
print("ready" if ok else "not shown", flush=True)
mode = sys.stdin.readline().strip()
if mode == "follow":  # keep working until stdin closes
    import threading
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    i = 30
    while not done.is_set() and i < 3000:
        work(cache, 1, i)
        i += 1
        time.sleep(0.02)
elif mode == "crash":
    os._exit(0)  # no close: the stats file says running, the pid is gone
cache.close()
"""


def engine(cfg: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(cfg), str(Path(__file__).parent)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_stats_of_a_running_engine_then_closed(tmp_path: Path) -> None:
    cfg = write_toml(tmp_path)
    child = engine(cfg)
    try:
        assert child.stdout is not None
        live = json.loads(child.stdout.readline())
        assert child.stdout.readline().strip() == "ready"
        r = run("stats", str(cfg), "--json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        assert doc["source"] == "telemetry" and doc["state"] == "running"
        assert doc["pid"] == child.pid and doc["namespace"] == "tel"
        for tier in ("cpu", "nvme"):
            for c in ("hits", "misses", "stored", "evictions", "used_blocks", "capacity_blocks"):
                assert doc["tiers"][tier][c] == live[tier][c], (tier, c)
        # 30 gets of 2 blocks, served by the cpu tier or, when write-through copies pinned
        # its room at the put, by nvme (the put wrote around it)
        assert live["cpu"]["hits"] + live["nvme"]["hits"] == 60 and live["nvme"]["stored"] > 0
        assert doc["tiers"]["nvme"]["path"] == str(tmp_path / "nvme")
        r = run("stats", str(tmp_path / "tel"))  # the directory itself, human form
        assert r.exit_code == 0, r.output
        assert f"engine pid {child.pid} running" in r.output
        assert " 8/8 " in r.output  # cpu used/capacity
    finally:
        child.communicate("close\n", timeout=60)
    r = run("stats", str(cfg), "--json", "--tier", "nvme")
    doc = json.loads(r.stdout)
    assert doc["state"] == "closed" and list(doc["tiers"]) == ["nvme"]


def test_stats_of_an_engine_that_died(tmp_path: Path) -> None:
    cfg = write_toml(tmp_path)
    child = engine(cfg)
    assert child.stdout is not None
    child.stdout.readline()
    assert child.stdout.readline().strip() == "ready"
    child.communicate("crash\n", timeout=60)
    r = run("stats", str(cfg), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["state"] == "dead" and doc["closed"] is False


def test_stats_from_the_prometheus_endpoint(tmp_path: Path) -> None:
    with TierCache.open(config(tmp_path, prometheus="127.0.0.1:0"), block_bytes=BB) as cache:
        work(cache, 12)
        port = cache._telemetry.prometheus_port  # port 0 picked a free one
        want = cache.stats()

        counters = ("hits", "misses", "evictions", "errors", "used_blocks", "capacity_blocks")

        def current() -> bool:
            r = run("stats", f"http://127.0.0.1:{port}/metrics", "--json")
            if r.exit_code != 0:  # no tiercache_tier_* metrics before the first interval
                return False
            got = json.loads(r.stdout)["tiers"]
            return all(got[t][c] == want[t][c] for t in ("cpu", "nvme") for c in counters)

        # The endpoint serves what the last telemetry interval saw: wait for the counters.
        wait_until(current, "the Prometheus endpoint shows the final counters")
        r = run("stats", f"http://127.0.0.1:{port}/metrics", "--json")
        assert r.exit_code == 0, r.output
        got = json.loads(r.stdout)["tiers"]
        for tier in ("cpu", "nvme"):
            for c in counters:
                assert got[tier][c] == want[tier][c], (tier, c)
    r = run("stats", f"http://127.0.0.1:{port}/metrics")
    assert r.exit_code == 2 and "cannot fetch metrics" in r.output  # closed with the cache


def test_stats_of_a_store_on_disk(tmp_path: Path) -> None:
    cfg = {**config(tmp_path)}
    del cfg["telemetry"]
    with TierCache.open(cfg, block_bytes=BB) as cache:
        assert cache._telemetry is None  # off by default
        work(cache, 12)
    assert not (tmp_path / "tel").exists()
    r = run("stats", str(tmp_path / "nvme"), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["source"] == "disk"
    nv = doc["tiers"]["nvme"]
    assert nv["blocks"] == 16 and nv["capacity_blocks"] == 16  # close wrote the cpu tier down
    r = run("stats", str(tmp_path / "nvme"))
    assert "stores on disk" in r.output and "16" in r.output


def test_events_match_take_events_and_stay_with_the_caller(tmp_path: Path) -> None:
    with TierCache.open(config(tmp_path), block_bytes=BB) as cache:
        work(cache, 10)
        taken = cache.take_events()  # telemetry copies events; the caller still gets them
        assert cache.take_events() == []
    taken += cache.take_events()  # the write-back at close
    assert {e.medium for e in taken} == {"cpu", "nvme"} and any(e.removed for e in taken)
    r = run("events", str(tmp_path / "tel"), "--json", "--last", "1000")
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["medium"], x["op"], x["keys"]) for x in lines] == [
        (e.medium, "removed" if e.removed else "stored", [k.hex() for k in e.keys]) for e in taken
    ]
    ts = [x["t"] for x in lines]
    assert ts == sorted(ts) and abs(ts[-1] - time.time()) < 60
    # Human lines, last 3, one tier.
    r = run("events", str(tmp_path / "tel"), "-n", "3", "--tier", "nvme")
    rows = r.output.strip().splitlines()
    nv = [x for x in lines if x["medium"] == "nvme"][-3:]
    assert len(rows) == 3 and all(" nvme " in row for row in rows)
    assert [row.split()[2] for row in rows] == [x["op"] for x in nv]
    words, keys = rows[-1].split(), nv[-1]["keys"]
    if len(keys) > 1:  # first key, then "+N" more
        assert words[-2] == keys[0] and words[-1].startswith("+")
    else:
        assert words[-1] == keys[0]


def test_events_follow_a_running_engine(tmp_path: Path) -> None:
    cfg = write_toml(tmp_path)
    child = engine(cfg)
    try:
        assert child.stdout is not None
        child.stdout.readline()
        assert child.stdout.readline().strip() == "ready"
        assert child.stdin is not None
        child.stdin.write("follow\n")
        child.stdin.flush()
        t0 = time.time()
        r = run("events", str(cfg), "--follow", "-n", "0", "--count", "6", "--timeout", "60")
        assert r.exit_code == 0, r.output
        rows = r.output.strip().splitlines()
        assert len(rows) == 6
        assert all(row.split()[2] in ("stored", "removed") for row in rows)
        assert time.time() - t0 < 60
        # --timeout ends a follow that sees nothing (a tier with no events).
        r = run("events", str(cfg), "-f", "-n", "0", "--tier", "lmdb", "--timeout", "0.3")
        assert r.exit_code == 0 and r.output == ""
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def test_events_rotate_within_their_bound(tmp_path: Path) -> None:
    with TierCache.open(config(tmp_path, max_event_bytes="4KiB"), block_bytes=BB) as cache:
        for i in range(12):
            work(cache, 3, i * 3)
            time.sleep(0.06)
        taken = cache.take_events()
    tel = tmp_path / "tel"
    assert (tel / (EVENTS_FILE + ".1")).exists()
    for name in (EVENTS_FILE, EVENTS_FILE + ".1"):
        assert (tel / name).stat().st_size <= 4096 + 4096  # the bound plus one batch
    kept = read_events(tel)
    assert 0 < len(kept) < len(taken)
    # What is kept is the newest events, in order.
    tail = [(e.medium, [k.hex() for k in e.keys]) for e in taken][-len(kept) :]
    assert [(x["medium"], x["keys"]) for x in kept] == tail


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({}, "telemetry.dir: required"),
        ({"dir": "x", "interval": 0}, "telemetry.interval: expected seconds"),
        ({"dir": "x", "events": "yes"}, "telemetry.events: expected true or false"),
        ({"dir": "x", "max_event_bytes": "lots"}, "telemetry.max_event_bytes: cannot parse"),
        ({"dir": "x", "prometheus": "9464"}, "telemetry.prometheus: expected 'host:port'"),
        ({"dir": "x", "port": 1}, "telemetry.port: unknown setting"),
        ("x", "telemetry: expected a table"),
    ],
)
def test_telemetry_config_errors_name_the_field(table: object, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        CacheConfig.from_mapping({"tiers": [{"kind": "cpu", "blocks": 1}], "telemetry": table})
    assert str(e.value).startswith(message)


def test_telemetry_dir_that_cannot_be_made_fails_the_open(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    cfg = config(tmp_path)
    cfg["telemetry"]["dir"] = str(tmp_path / "file" / "tel")
    with pytest.raises(ConfigError, match=r"^telemetry\.dir: .*the parent is not a directory"):
        TierCache.open(cfg, block_bytes=BB)


def test_adapter_sections_reach_stats_and_inspect(tmp_path: Path) -> None:
    """An adapter's snapshot section (the KV connector's `kv_groups`) is written with the
    tiers' stats and shown by `tiercache stats` and `tiercache inspect` on the config; a
    failing section costs nothing else, and the cache's own sections cannot be replaced."""
    path = write_toml(tmp_path)
    cache = TierCache.open(path, block_bytes=BB)
    groups = {
        "block_size": 32,
        "kept_tokens": 2048,
        "groups": [
            {"group": 0, "kind": "sliding_window", "layers": 2, "window_blocks": 2,
             "block_bytes": 16384, "kept_blocks": 4, "bytes_per_token": 32.0},
            {"group": 1, "kind": "full_attention", "layers": 2, "window_blocks": 0,
             "block_bytes": 16384, "kept_blocks": 64, "bytes_per_token": 512.0},
        ],
    }  # fmt: skip
    cache.add_snapshot_section("kv_groups", lambda: groups)
    cache.add_snapshot_section("broken", lambda: 1 / 0)
    with pytest.raises(ValueError, match="'tiers' is a section of the cache's own"):
        cache.add_snapshot_section("tiers", dict)
    work(cache, 3)
    cache.close()
    stats = run("stats", str(path), "--json")
    assert stats.exit_code == 0, stats.output
    doc = json.loads(stats.output)
    assert doc["kv_groups"] == groups and "broken" not in doc and doc["tiers"]["nvme"]["stored"]
    shown = run("stats", str(path))
    assert "KV cache groups" in shown.output and "sliding" in shown.output
    inspected = run("inspect", str(path), "--json")
    assert inspected.exit_code == 0, inspected.output
    assert json.loads(inspected.output)["kv_groups"]["groups"] == groups["groups"]
    text = run("inspect", str(path))
    assert "bytes/token" in text.output and "512.0" in text.output


def test_stats_shows_every_rank_of_a_tensor_parallel_engine(tmp_path: Path) -> None:
    """With TP (or DP) > 1 each rank is a process with its own cache and writes its own
    telemetry under the configured directory (`dir/tp0of2`, ...): `stats` on the config, or on
    the directory, shows every rank instead of reporting that there are no stats."""
    cfg = write_toml(tmp_path)
    user = config(tmp_path)
    for d in ("nvme", "tel"):  # the configured paths; each rank opens a subdirectory
        (tmp_path / d).mkdir()
    caches = []
    try:
        for rank in range(2):
            rc = resolve_rank_config(
                user, block_size=16, key_namespace="tel", store_namespace="tel",
                tp_rank=rank, tp_size=2,
            )  # fmt: skip
            cache = TierCache.open(rc.config, block_bytes=BB)
            caches.append(cache)
            work(cache, 3 + rank)  # the ranks' counters differ

        def shown(rank: int) -> bool:
            try:
                doc = read_stats(tmp_path / "tel" / f"tp{rank}of2")
            except ValueError:
                return False
            want = caches[rank].stats()["cpu"]
            return all(doc["tiers"]["cpu"][c] == want[c] for c in COUNTERS)

        for rank in range(2):  # a telemetry write after the work, per rank
            wait_until(lambda r=rank: shown(r), f"rank {rank}'s stats file shows its counters")
        for target in (cfg, tmp_path / "tel"):
            r = run("stats", str(target), "--json", "--tier", "cpu")
            assert r.exit_code == 0, r.output
            doc = json.loads(r.stdout)
            assert list(doc["ranks"]) == ["tp0of2", "tp1of2"]
            for rank, one in enumerate(doc["ranks"].values()):
                assert one["state"] == "running" and one["pid"] == os.getpid()
                assert list(one["tiers"]) == ["cpu"]
                assert one["tiers"]["cpu"]["hits"] == caches[rank].stats()["cpu"]["hits"]
        r = run("stats", str(cfg))
        assert r.exit_code == 0, r.output
        assert "rank tp0of2" in r.output and "rank tp1of2" in r.output
    finally:
        for cache in caches:
            cache.close()
    doc = json.loads(run("stats", str(cfg), "--json").stdout)
    assert [one["state"] for one in doc["ranks"].values()] == ["closed", "closed"]
