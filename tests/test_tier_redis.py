"""Redis tier: the persistent conformance suite (raw and zstd), a state machine, and scenarios on
real `redis-server` processes on loopback ports: two processes sharing a store, a 3-node
Redis Cluster, a server killed and restarted mid-run, a hung server, authentication, values
corrupted or evicted in Redis, TTL, configuration errors."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import redis
import torch

from tests.persistent_conformance import PersistentTierConformance
from tests.ports import free_port
from tests.tier_conformance import keys_for, rand_blocks, tier_state_machine
from tiercache import TierCache
from tiercache.config import CacheConfig
from tiercache.errors import ConfigError
from tiercache.tiers import tier_class
from tiercache.tiers.format import HEADER_SIZE
from tiercache.tiers.redis import RedisTier
from tiercache.tiers.redis import tier as redis_tier
from tiercache.tiers.redis.client import parse_nodes

REPO = Path(__file__).resolve().parents[1]
REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
# Under CI (CI=true, as CI services set it) a missing Redis fails the tests that need it: a
# CI run that skipped them would pass without testing the Redis tier.
IN_CI = os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_redis(tool: str = "redis-server") -> str:
    """The path of `tool` (redis-server or redis-cli). Where it is not installed: a skip, or
    under CI=true a failure."""
    path = REDIS_CLI if tool == "redis-cli" else REDIS_SERVER
    if path is None:
        why = f"{tool} is not installed (CI installs Debian's redis-server package)"
        if IN_CI:
            pytest.fail(f"{why}, and CI=true: the Redis tests must run in CI", pytrace=False)
        pytest.skip(why)
    return path


@pytest.fixture(scope="session", autouse=True)  # before the module's server fixtures
def _redis_required() -> None:
    require_redis()


class RedisServer:
    """A redis-server child process on a loopback port, in its own directory."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.port = port or free_port(also=10000 if "--cluster-enabled" in args else 0)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                *("--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)),
                *("--save", "", "--daemonize", "no", *self.args),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):  # +PONG, or -NOAUTH when a password is required
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {(self.dir / 'server.log')}")
            time.sleep(0.02)

    def client(self, **kw) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process must not linger
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="session")
def server():
    d = Path(tempfile.mkdtemp(prefix="tc-redis-"))
    srv = RedisServer(d, "--appendonly", "no")
    yield srv
    srv.kill()
    shutil.rmtree(d, ignore_errors=True)


_ids = itertools.count()


def unique_prefix(tag: str = "t") -> str:
    return f"tc-test:{os.getpid()}:{tag}{next(_ids)}:"


def open_tier(server: RedisServer, capacity: int = 16, block_bytes: int = 4096, **kw) -> RedisTier:
    kw.setdefault("prefix", unique_prefix())
    kw.setdefault("namespace", "model/bf16")
    return RedisTier(url=server.url, block_bytes=block_bytes, capacity_blocks=capacity, **kw)


def corrupt_value(client: redis.Redis, rkey: bytes, nbytes: int = 3) -> None:
    v = bytearray(client.get(rkey))
    for i in range(1, nbytes + 1):
        v[-i] ^= 0xFF
    client.set(rkey, bytes(v))


# -- conformance ---------------------------------------------------------------------------


class TestRedisTier(PersistentTierConformance):
    compression = "none"

    @pytest.fixture(autouse=True)
    def _server(self, server) -> None:
        self.srv = server

    def _prefix(self, tmp_path) -> str:
        # Same tmp_path -> same store; the brackets pytest may put in names test SCAN escaping.
        return f"tc-conf:[{tmp_path.name}]*?:"

    def make_tier(self, capacity_blocks, block_bytes, tmp_path):
        return RedisTier(
            url=self.srv.url,
            block_bytes=block_bytes,
            capacity_blocks=capacity_blocks,
            prefix=self._prefix(tmp_path),
            namespace="conformance",
            compression=self.compression,
        )

    def corrupt(self, tmp_path, key: bytes) -> None:
        rkey = self._prefix(tmp_path).encode() + b"conformance" + key
        corrupt_value(self.srv.client(), rkey)

    def test_flags_and_kind(self, tier) -> None:
        assert (tier.kind, tier.persistent, tier.shared, tier.medium) == (
            "redis",
            True,
            True,
            "redis",
        )
        assert tier_class("redis") is RedisTier


class TestRedisTierZstd(TestRedisTier):
    compression = "zstd"


def _machine_tier(capacity: int, block_bytes: int) -> RedisTier:
    url = os.environ["TC_TEST_REDIS_URL"]
    return RedisTier(
        url=url, block_bytes=block_bytes, capacity_blocks=capacity, prefix=unique_prefix("sm")
    )


def test_state_machine(server, monkeypatch) -> None:
    monkeypatch.setenv("TC_TEST_REDIS_URL", server.url)
    tier_state_machine(_machine_tier).TestCase().runTest()


# -- layout, sharing, capacity --------------------------------------------------------------


def test_key_and_value_layout(server) -> None:
    t = open_tier(server, prefix="tc-layout:", namespace="ns1", block_bytes=256)
    try:
        keys = keys_for(2, 7)
        data = rand_blocks(2, 256, 1)
        t.write(t.allocate(keys), data, keys)
        c = server.client()
        v = c.get(b"tc-layout:ns1" + keys[0])
        assert v is not None and len(v) == HEADER_SIZE + 256
        assert v[:4] == b"TCB\x01" and v[8:24] == keys[0]
        assert v[HEADER_SIZE:] == data[0].numpy().tobytes()
        assert c.ttl(b"tc-layout:ns1" + keys[0]) == -1  # no ttl configured: no expiry
    finally:
        t.close()


def test_other_namespace_sees_nothing(server) -> None:
    a = open_tier(server, prefix="tc-ns:", namespace="a")
    keys = keys_for(3)
    a.write(a.allocate(keys), rand_blocks(3, 4096), keys)
    a.close()
    b = open_tier(server, prefix="tc-ns:", namespace="ab")  # "a" is a prefix of "ab"
    try:
        assert b.recover() == []
    finally:
        b.close()


def test_free_deletes_at_next_write_and_flush(server) -> None:
    t = open_tier(server, capacity=8)
    c = server.client()
    try:
        keys = keys_for(4)
        slots = t.allocate(keys)
        t.write(slots, rand_blocks(4, 4096), keys)
        t.free(slots[:2])
        # A demotion planned with the eviction still reads freed slots: nothing deleted yet.
        assert c.exists(*(t.redis_key(k) for k in keys)) == 4
        assert t.stats()["pending_deletes"] == 2
        more = keys_for(1, 50)
        t.write(t.allocate(more), rand_blocks(1, 4096), more)  # deletes ride along
        assert c.exists(*(t.redis_key(k) for k in keys[:2])) == 0
        t.free(slots[2:3])
        t.flush()
        assert c.exists(t.redis_key(keys[2])) == 0 and c.exists(t.redis_key(keys[3])) == 1
    finally:
        t.close()


def test_key_freed_then_stored_again_is_not_deleted(server) -> None:
    t = open_tier(server, capacity=4)
    try:
        keys = keys_for(2)
        slots = t.allocate(keys)
        t.write(slots, rand_blocks(2, 4096), keys)
        t.free(slots[:1])
        again = t.allocate(keys[:1])
        t.write(again, rand_blocks(1, 4096, 3), keys[:1])
        t.flush()
        out = torch.empty((1, 4096), dtype=torch.uint8)
        assert t.read(again, out, keys[:1]) == []
        assert torch.equal(out, rand_blocks(1, 4096, 3))
    finally:
        t.close()


def test_a_failed_flush_never_deletes_a_key_stored_again_meanwhile(server, monkeypatch) -> None:
    # flush() sends its deletes outside the tier's lock. If another thread stores a freed key
    # again meanwhile and the send fails, the delete went back to pending, and the next
    # flush deleted the live block.
    t = open_tier(server, capacity=4, block_bytes=256)
    c = server.client()
    try:
        keys = keys_for(2, 9)
        slots = t.allocate(keys)
        t.write(slots, rand_blocks(2, 256, 1), keys)
        t.free(slots[:1])
        run = t._run
        again: list[int] = []

        def fails_after_a_store(client, cmds, what):
            if what == "delete":  # the other thread's store lands while the deletes are out
                again.extend(t.allocate(keys[:1]))
                t.write(again, rand_blocks(1, 256, 5), keys[:1])
                raise OSError(104, "connection reset (injected)")
            return run(client, cmds, what)

        monkeypatch.setattr(t, "_run", fails_after_a_store)
        with pytest.raises(OSError, match="injected"):
            t.flush()
        monkeypatch.setattr(t, "_run", run)
        assert t.stats()["pending_deletes"] == 0
        t.flush()
        assert c.exists(t.redis_key(keys[0])) == 1
        out = torch.empty((1, 256), dtype=torch.uint8)
        assert t.read(again, out, keys[:1]) == []
        assert torch.equal(out, rand_blocks(1, 256, 5))
    finally:
        t.close()


def test_recovery_keeps_the_newest_capacity_blocks(server) -> None:
    prefix = unique_prefix("cap")
    t = open_tier(server, capacity=8, prefix=prefix)
    keys = keys_for(8)
    for i in range(8):
        (s,) = t.allocate([keys[i]])
        t.write([s], rand_blocks(1, 4096, i), [keys[i]])
    t.close()
    small = open_tier(server, capacity=3, prefix=prefix)  # another instance, a smaller share
    try:
        assert [k for k, _ in small.recover()] == keys[5:]
        assert small.used_blocks == 3
    finally:
        small.close()
    assert server.client().exists(*(prefix.encode() + b"model/bf16" + k for k in keys)) == 8


STORE_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from tiercache import TierCache
    url, prefix, out = sys.argv[1:4]
    cfg = {"namespace": "shared-test", "tiers": [
        {"kind": "cpu", "blocks": 4},
        {"kind": "redis", "blocks": 64, "url": url, "prefix": prefix},
    ]}
    g = torch.Generator().manual_seed(1234)
    tokens = list(range(16 * 12))
    with TierCache.open(cfg, block_bytes=8192) as cache:
        keys = cache.hash_tokens(tokens)
        blocks = torch.randint(0, 256, (len(keys), 8192), dtype=torch.uint8, generator=g)
        for i in range(0, len(keys), 4):  # earlier groups are demoted to Redis
            assert cache.put(keys[i : i + 4], blocks[i : i + 4]) == 4
        media = sorted({e.medium for e in cache.take_events()})
    torch.save({"keys": keys, "blocks": blocks, "media": media}, out)
    """
)


def test_two_processes_share_a_store(server, tmp_path) -> None:
    """Process A stores 12 blocks (4 stay in its CPU tier, 8 are demoted to Redis, the rest
    written back at close); process B, opened afterwards, hits all 12 from Redis."""
    prefix = unique_prefix("share")
    out = tmp_path / "stored.pt"
    subprocess.run(
        [sys.executable, "-c", STORE_SCRIPT, server.url, prefix, str(out)],
        check=True,
        timeout=120,
        cwd=REPO,
    )
    stored = torch.load(out, weights_only=True)
    assert "redis" in stored["media"]  # A's events name the Redis tier's medium
    cfg = {
        "namespace": "shared-test",
        "tiers": [
            {"kind": "cpu", "blocks": 16},
            {"kind": "redis", "blocks": 64, "url": server.url, "prefix": prefix},
        ],
    }
    with TierCache.open(cfg, block_bytes=8192) as cache:
        keys = cache.hash_tokens(list(range(16 * 12)))
        assert keys == stored["keys"]  # same chained keys in every process
        assert cache.lookup(keys) == 12
        got = cache.get(keys)
        assert torch.equal(got, stored["blocks"])  # bytes identical
        st = cache.stats()["redis"]
        assert st["loaded"] == 12 and st["errors"] == 0


# -- cluster --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_redis("redis-cli")  # it creates the cluster
    base = tmp_path_factory.mktemp("cluster")
    nodes = []
    try:
        for i in range(3):
            nodes.append(
                RedisServer(
                    base / f"n{i}",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    "--appendonly",
                    "no",
                )
            )
        addrs = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while any(n.client().cluster("INFO").get("cluster_state") != "ok" for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not converge")
            time.sleep(0.1)
        yield nodes
    finally:
        for n in nodes:
            n.kill()


@pytest.mark.parametrize("form", ["url", "list"])
def test_cluster_round_trip_and_recovery(cluster, form) -> None:
    url = (
        "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in cluster[:2])
        if form == "url"
        else [f"127.0.0.1:{n.port}" for n in cluster]
    )
    prefix = unique_prefix("cl")
    keys = keys_for(48)
    data = rand_blocks(48, 1024, 5)
    t = RedisTier(url=url, block_bytes=1024, capacity_blocks=64, prefix=prefix)
    watcher = RedisTier(url=url, block_bytes=1024, capacity_blocks=64, prefix=prefix)
    try:
        assert t.available
        slots = t.allocate(keys)
        t.write(slots, data, keys)  # one call, pipelined per node
        assert watcher.probe(keys) == 48  # headers fetched from all three nodes
        out = torch.empty_like(data)
        assert t.read(slots, out, keys) == []
        assert torch.equal(out, data)
    finally:
        t.close()
        watcher.close()
    # The keys are spread over the three nodes (hash slots), not pinned to one.
    per_node = [len(n.client().keys(prefix.encode() + b"*")) for n in cluster]
    assert sum(per_node) == 48 + 1  # + the store's metadata key
    assert sum(1 for c in per_node if c) == 3
    t2 = RedisTier(url=url, block_bytes=1024, capacity_blocks=64, prefix=prefix)
    try:
        rec = t2.recover()  # SCAN over every primary
        assert sorted(k for k, _ in rec) == keys
        pos = {k: s for k, s in rec}
        out = torch.empty_like(data)
        assert t2.read([pos[k] for k in keys], out, keys) == []
        assert torch.equal(out, data)
    finally:
        t2.close()


def test_cluster_through_tiercache_config(cluster) -> None:
    cfg = {
        "tiers": [
            {"kind": "cpu", "blocks": 2},
            {
                "kind": "redis",
                "blocks": 32,
                "url": [f"127.0.0.1:{n.port}" for n in cluster],
                "prefix": unique_prefix("clc"),
                "write_policy": "write-back",  # counts demotions below
            },
        ]
    }
    keys = keys_for(10)
    data = rand_blocks(10, 2048, 6)
    with TierCache.open(cfg, block_bytes=2048) as cache:
        for i in range(0, 10, 2):  # each pair evicts the previous one into the cluster
            cache.put(keys[i : i + 2], data[i : i + 2])
        assert torch.equal(cache.get(keys), data)
        assert cache.stats()["redis"]["demoted_in"] == 8


# -- failures -------------------------------------------------------------------------------


def _two_tier_cache(url: str, prefix: str, **redis_opts) -> TierCache:
    cfg = {
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            # write-back: these tests follow demotions and the CPU tier's own serving
            {
                "kind": "redis",
                "blocks": 64,
                "url": url,
                "prefix": prefix,
                "write_policy": "write-back",
                **redis_opts,
            },
        ]
    }
    return TierCache.open(cfg, block_bytes=4096)


def _wait_backoff(tier: RedisTier) -> None:
    """Until the tier's retry is due (`retry_at`, the monotonic time its back-off ends)."""
    time.sleep(max(0.0, tier.retry_at - time.monotonic()) + 0.01)


def test_backoff_doubles_from_twice_the_start_at_open_up_to_the_max() -> None:
    """The availability back-off (tiercache/backoff.py): a failed open waits 0.2 s, each
    failure while down doubles it up to backoff_max, a success resets it to 0.1 s."""
    t = RedisTier(
        url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens: refused at once
        block_bytes=64,
        capacity_blocks=4,
        backoff_max=0.5,
    )
    try:
        assert not t.available
        assert t._backoff.period == pytest.approx(0.2)
        with pytest.raises(OSError, match="unavailable"):
            t._conn()  # inside the wait: no network
        assert t.stats()["skipped_calls"] == 1
        periods = []
        for _ in range(3):
            t._mark_down(OSError("refused"), "read")
            periods.append(t._backoff.period)
        assert periods == pytest.approx([0.4, 0.5, 0.5])
        t._mark_up()
        t._mark_down(OSError("refused"), "read")
        assert t._backoff.period == pytest.approx(redis_tier.BACKOFF_START_S)
        assert t.stats()["disconnects"] == 1 and t.stats()["reconnects"] == 1
    finally:
        t.close()


def test_server_killed_and_restarted_mid_run(tmp_path, monkeypatch) -> None:
    """The cache keeps serving from its CPU tier while Redis is gone, never raises, skips
    Redis during the backoff, and uses it again after the restart."""
    monkeypatch.setattr(redis_tier, "BACKOFF_START_S", 2.0)  # room for the steps below
    srv = RedisServer(tmp_path / "r", "--appendonly", "yes", "--appendfsync", "always")
    try:
        cache = _two_tier_cache(srv.url, "tc-restart:", timeout=0.3)
        tier = cache.tiers[1]
        assert isinstance(tier, RedisTier)
        a, b = keys_for(4), keys_for(4, 100)
        da, db = rand_blocks(4, 4096, 1), rand_blocks(4, 4096, 2)
        cache.put(a, da)
        cache.put(b, db)  # the CPU tier (4 blocks) now holds b; a was demoted to Redis
        assert cache.manager.where(a[0]) == [1] and cache.manager.where(b[0]) == [0]

        srv.kill()  # Redis gone, mid-run
        assert torch.equal(cache.get(b), db)  # served from the CPU tier
        assert cache.get(a).shape[0] == 0  # a miss, not an exception
        assert not tier.available
        assert cache.stats()["redis"]["errors"] == 4
        c = keys_for(4, 200)
        dc = rand_blocks(4, 4096, 3)
        # The failed read suspended Redis in the manager (its circuit breaker): b is evicted
        # from the CPU tier without a demotion into Redis, and no network call is made.
        assert cache.manager.suspended()[1] > 0
        assert cache.put(c, dc) == 4
        assert tier.stats()["skipped_calls"] == 0
        assert torch.equal(cache.get(c), dc)

        srv.start()  # the same port, the append-only file replayed
        _wait_backoff(tier)
        d = keys_for(4, 300)
        cache.put(d, rand_blocks(4, 4096, 4))  # c is demoted into Redis: the probe call
        assert tier.available
        s = tier.stats()
        assert (s["disconnects"], s["reconnects"]) == (1, 1)
        assert cache.manager.where(c[0]) == [1]
        assert torch.equal(cache.get(c), dc)  # read back from Redis
        # Blocks of `a` dropped from this cache's index while Redis was down were not deleted
        # from Redis: they were fine, and other instances may use them.
        assert srv.client().exists(*(tier.redis_key(k) for k in a)) == 4
        cache.close()
    finally:
        srv.kill()


def test_hung_server_times_out_and_recovers(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(redis_tier, "BACKOFF_START_S", 2.0)
    srv = RedisServer(tmp_path / "h")
    try:
        t = open_tier(srv, capacity=8, timeout=0.2)
        keys = keys_for(2)
        slots = t.allocate(keys)
        data = rand_blocks(2, 4096, 1)
        t.write(slots, data, keys)
        assert t.retry_at == 0.0  # reachable: nothing to wait for
        srv.pause()  # accepts connections, answers nothing: a "slow" server
        try:
            with pytest.raises(OSError, match="read failed: TimeoutError"):
                t.read(slots, torch.empty_like(data), keys)
            assert not t.available
            assert t.retry_at == pytest.approx(time.monotonic() + 2.0, abs=0.5)
            with pytest.raises(OSError, match="unavailable"):  # fails fast in the backoff
                t.read(slots, torch.empty_like(data), keys)
        finally:
            srv.resume()
        _wait_backoff(t)
        out = torch.empty_like(data)
        assert t.read(slots, out, keys) == []
        assert torch.equal(out, data) and t.available and t.retry_at == 0.0
        s = t.stats()
        assert (s["disconnects"], s["reconnects"], s["skipped_calls"]) == (1, 1, 1)
        t.close()
    finally:
        srv.kill()


def test_a_stopped_server_suspends_its_tier_in_the_cache(tmp_path) -> None:
    """Issue 16: through the facade, a read that times out on a stopped server suspends the
    Redis tier (the manager's circuit breaker), so the next requests miss at once instead of
    each waiting out the timeout again; blocks in the CPU tier still serve, and once the
    server is back and the back-off ends, Redis hits again."""
    srv = RedisServer(tmp_path / "s")
    cfg = {
        "tiers": [
            {"kind": "cpu", "blocks": 2},
            {"kind": "redis", "url": srv.url, "blocks": 16, "timeout": 0.3},
        ],
        "deadlines": {"backoff": 1.0, "backoff_max": 1.0},
    }
    cache = TierCache.open(cfg, block_bytes=4096)
    try:
        bs = cache.config.block_size
        old = cache.hash_tokens(list(range(4 * bs)))  # the head in both tiers, 2 in Redis
        data = rand_blocks(4, 4096, 3)
        cache.put(old, data)
        cache.flush()
        where = [cache.manager.where(k) for k in old]
        assert where == [[0, 1], [0, 1], [1], [1]], where
        srv.pause()
        try:
            t0 = time.monotonic()
            got = cache.get(old)  # the CPU tier's head; the Redis read times out: a miss
            first = time.monotonic() - t0
            assert got.shape[0] == 2 and torch.equal(got, data[:2])
            assert cache.manager.suspended()[1] > 0
            t0 = time.monotonic()
            for _ in range(5):
                assert cache.get(old).shape[0] == 2
            assert time.monotonic() - t0 < 0.1 < first  # no more waits on the server
        finally:
            srv.resume()
        # The back-off (1 s) ends: wait for the breaker to say so, not for a fixed time.
        until = time.monotonic() + 30.0
        while cache.manager.suspended()[1] > 0:
            assert time.monotonic() < until, "the Redis tier stayed suspended"
            time.sleep(0.01)
        got = cache.get(old)
        assert got.shape[0] == 4 and torch.equal(got, data)
        assert cache.stats()["redis"]["suspensions"] >= 1
    finally:
        cache.close()
        srv.kill()


def test_server_down_at_open_starts_unavailable(tmp_path) -> None:
    port = free_port()
    t = RedisTier(url=f"redis://127.0.0.1:{port}/0", block_bytes=64, capacity_blocks=4, timeout=0.2)
    try:
        assert not t.available and t.recover() == []
        keys = keys_for(1)
        slots = t.allocate(keys)
        with pytest.raises(OSError):
            t.write(slots, rand_blocks(1, 64), keys)
        srv = RedisServer(tmp_path / "late", port=port)
        try:
            _wait_backoff(t)
            t.write(slots, rand_blocks(1, 64), keys)
            assert t.available
        finally:
            srv.kill()
    finally:
        t.close()


def test_server_down_at_cluster_open_starts_unavailable() -> None:
    t = RedisTier(
        url=f"redis+cluster://127.0.0.1:{free_port()}",
        block_bytes=64,
        capacity_blocks=4,
        timeout=0.2,
    )
    try:
        assert not t.available
        with pytest.raises(OSError):
            t.read([0], torch.empty((1, 64), dtype=torch.uint8), keys_for(1))
    finally:
        t.close()


# -- authentication ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("auth"), "--requirepass", "s3cret-pw")
    yield srv
    srv.kill()


def test_auth_required_and_wrong_password(auth_server, monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ConfigError, match="requires authentication"):
        open_tier(auth_server)
    with pytest.raises(ConfigError, match="refused the credentials") as exc:
        open_tier(auth_server, password="not-it")
    assert "not-it" not in str(exc.value)
    cfg = {
        "tiers": [
            {"kind": "redis", "blocks": 4, "url": auth_server.url, "password": "nope"},
        ]
    }
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.password: .*refused the credentials"):
        TierCache.open(cfg, block_bytes=64)
    monkeypatch.setenv("TC_REDIS_PW", "s3cret-pw")
    t = open_tier(auth_server, password_env="TC_REDIS_PW", username="default")
    try:
        keys = keys_for(1)
        t.write(t.allocate(keys), rand_blocks(1, 4096), keys)
        assert "s3cret" not in repr(t)
    finally:
        t.close()
    url = f"redis://:s3cret-pw@127.0.0.1:{auth_server.port}/0"  # a password in the URL
    t = RedisTier(url=url, block_bytes=64, capacity_blocks=2)
    try:
        assert t.available and "s3cret" not in repr(t) and "***" in repr(t)
    finally:
        t.close()
    assert "s3cret" not in caplog.text and "not-it" not in caplog.text


def test_password_env_must_be_set(auth_server, monkeypatch) -> None:
    monkeypatch.delenv("TC_REDIS_NO_SUCH_VAR", raising=False)
    with pytest.raises(ConfigError, match="password_env: environment variable"):
        open_tier(auth_server, password_env="TC_REDIS_NO_SUCH_VAR")


# -- corrupt, foreign, evicted, expiring values -------------------------------------------------


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_corrupt_and_foreign_values_are_counted_misses(server, compression) -> None:
    t = open_tier(server, capacity=8, compression=compression)
    c = server.client()
    try:
        keys = keys_for(6)
        g = torch.Generator().manual_seed(3)
        data = torch.randn((6, 2048), generator=g).to(torch.bfloat16).view(torch.uint8)
        slots = t.allocate(keys)
        t.write(slots, data, keys)
        rk = [t.redis_key(k) for k in keys]
        corrupt_value(c, rk[1])  # flipped payload bytes
        c.set(rk[2], b"not a tiercache block at all")  # a foreign string
        c.set(rk[3], c.get(rk[0]))  # a valid record of another key
        c.delete(rk[4])  # gone: expired, evicted or deleted by another instance
        c.delete(rk[5])
        c.rpush(rk[5], b"x")  # another type under our key (WRONGTYPE)
        out = torch.empty_like(data)
        assert t.read(slots, out, keys) == [1, 2, 3, 4, 5]
        assert torch.equal(out[0], data[0])
        s = t.stats()
        assert (s["corrupt"], s["missing"], s["blocks_read"]) == (4, 1, 1)
    finally:
        t.close()


def test_corrupt_value_through_the_cache_is_a_counted_miss(server) -> None:
    prefix = unique_prefix("cc")
    keys = keys_for(4)
    data = rand_blocks(4, 4096, 9)
    with _two_tier_cache(server.url, prefix) as cache:
        cache.put(keys, data)
    c = server.client()
    corrupt_value(c, prefix.encode() + b"default" + keys[2])
    with _two_tier_cache(server.url, prefix) as cache:
        assert cache.lookup(keys) == 4
        got = cache.get(keys)
        assert torch.equal(got, data[:2])  # served up to the bad block, never past it
        st = cache.stats()["redis"]
        assert st["errors"] == 1
        assert cache.lookup(keys) == 2  # the bad block left the index
        assert cache.tiers[1].stats()["corrupt"] == 1


def test_keys_evicted_by_redis_maxmemory_are_misses(tmp_path) -> None:
    srv = RedisServer(tmp_path / "m", "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    try:
        t = open_tier(srv, capacity=64, block_bytes=64 * 1024)
        keys = keys_for(48)  # 3 MiB of values into 2 MiB: Redis evicts on its own
        data = rand_blocks(48, 64 * 1024, 1)
        slots = t.allocate(keys)
        for i in range(0, 48, 8):
            t.write(slots[i : i + 8], data[i : i + 8], keys[i : i + 8])
        out = torch.empty_like(data)
        failed = t.read(slots, out, keys)
        assert 0 < len(failed) < 48
        for i in set(range(48)) - set(failed):
            assert torch.equal(out[i], data[i])
        assert t.stats()["missing"] == len(failed) and t.stats()["corrupt"] == 0
        assert t.available
        t.close()
    finally:
        srv.kill()


def test_ttl_is_set_and_refreshed_by_reads(server) -> None:
    t = open_tier(server, capacity=4, ttl=30)
    c = server.client()
    try:
        keys = keys_for(1)
        slots = t.allocate(keys)
        t.write(slots, rand_blocks(1, 4096), keys)
        rk = t.redis_key(keys[0])
        assert 29_000 < c.pttl(rk) <= 30_000
        c.pexpire(rk, 5_000)
        assert t.read(slots, torch.empty((1, 4096), dtype=torch.uint8), keys) == []
        assert c.pttl(rk) > 29_000  # GETEX pushed the expiry back
    finally:
        t.close()


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opts", "field", "message"),
    [
        ({"url": "http://x:1"}, "tiers[0].url", "unknown scheme"),
        ({"url": "localhost:6379"}, "tiers[0].url", "expected a redis:// URL"),
        ({"url": []}, "tiers[0].url", "empty list"),
        ({"url": ["h:1", 5]}, "tiers[0].url[1]", "host:port"),
        ({"compression": "lz4"}, "tiers[0].compression", "expected one of"),
        ({"ttl": -1}, "tiers[0].ttl", ">= 0"),
        ({"timeout": 0}, "tiers[0].timeout", "> 0"),
        ({"password": "a", "password_env": "B"}, "tiers[0].password_env", "not both"),
        ({"username": ""}, "tiers[0].username", "non-empty"),
        ({"level": 99}, "tiers[0].level", "zstd level"),
        ({"hosts": "x"}, "tiers[0].hosts", "unknown option"),
        ({"ttl": True}, "tiers[0].ttl", "got bool"),
    ],
)
def test_config_errors_name_the_field(opts, field, message) -> None:
    with pytest.raises(ConfigError, match=message) as exc:
        CacheConfig.from_mapping({"tiers": [{"kind": "redis", "blocks": 4, **opts}]})
    assert exc.value.field == field


def test_parse_nodes() -> None:
    assert parse_nodes("redis://h:1/2") == (False, "redis://h:1/2")
    assert parse_nodes("rediss+cluster://u:p@a:1,b:2") == (
        True,
        ["rediss://u:p@a:1", "rediss://u:p@b:2"],
    )
    assert parse_nodes(["a:1", "redis://b:2"]) == (True, ["redis://a:1", "redis://b:2"])


# -- the transfer engine ------------------------------------------------------------------------


def test_transfer_engine_moves_blocks_through_redis(server) -> None:
    """Engine -> CPU tier -> Redis -> engine, and engine <-> Redis directly, as jobs on the
    worker (the Redis tier has no pool: the disk handler stages its batched reads/writes)."""
    from tests.test_transfer_common import K, assert_blocks, drain, make_kv, snapshot
    from tiercache.tiers.cpu import CPUTier
    from tiercache.transfer import GPULoadStoreSpec, KVLayout, TierLoadStoreSpec, build_worker

    caches, kv_first = make_kv("kv_separate", 32)
    layout = KVLayout(caches, 32, 2)
    cpu = CPUTier(block_bytes=layout.block_bytes, capacity_blocks=8)
    tier = open_tier(server, capacity=16, block_bytes=layout.block_bytes)
    want_a, want_c = snapshot(caches, kv_first, [0, 1, 2, 3]), snapshot(caches, kv_first, [16, 17])
    ka, kc = [K(100 + i) for i in range(2)], [K(200)]
    worker = build_worker(layout, [cpu, tier])
    try:
        worker.transfer_async(
            1, (GPULoadStoreSpec([0, 1, 2, 3]), TierLoadStoreSpec(0, "cpu", [0, 1], ka))
        )
        worker.transfer_async(
            2, (TierLoadStoreSpec(0, "cpu", [0, 1], ka), TierLoadStoreSpec(1, "redis", [4, 9], ka))
        )
        worker.transfer_async(
            3, (TierLoadStoreSpec(1, "redis", [4, 9], ka), GPULoadStoreSpec([8, 9, 10, 11]))
        )
        worker.transfer_async(
            4, (GPULoadStoreSpec([16, 17]), TierLoadStoreSpec(1, "redis", [0], kc))
        )
        worker.transfer_async(
            5, (TierLoadStoreSpec(1, "redis", [0], kc), GPULoadStoreSpec([24, 25]))
        )
        res = drain(worker, [1, 2, 3, 4, 5])
    finally:
        worker.close()
        tier.close()
    assert {i: r.success for i, r in res.items()} == dict.fromkeys(range(1, 6), True)
    assert res[2].transfer_type == ("cpu", "redis")
    assert_blocks(caches, kv_first, [8, 9, 10, 11], want_a)
    assert_blocks(caches, kv_first, [24, 25], want_c)


# -- live discovery: blocks another instance stores after this one opened --------------------


def test_blocks_another_instance_stores_later_are_found_by_lookup(server) -> None:
    """Two instances share one Redis store; each opened before the other stored anything.
    A lookup miss asks Redis for the missing headers and adopts what is there; the bytes come
    back verified, and counters say where they came from."""
    prefix = unique_prefix("live")
    keys = keys_for(8)
    data = rand_blocks(8, 4096, 21)
    with _two_tier_cache(server.url, prefix) as a, _two_tier_cache(server.url, prefix) as b:
        assert a.lookup(keys) == 0 and b.lookup(keys) == 0
        # b stores two 4-block runs; its CPU tier holds 4, so the first run is demoted to Redis.
        b.put(keys[:4], data[:4])
        b.put(keys[4:], data[4:])
        assert a.lookup(keys) == 4  # the rest sits in b's CPU tier only
        assert torch.equal(a.get(keys), data[:4])
        b.close()  # write-back: b's CPU-only blocks go down to Redis
        assert a.lookup(keys) == 8
        assert torch.equal(a.get(keys), data)
        st = a.stats()["redis"]
        assert st["discovered"] == 8 and st["errors"] == 0
        # Indexed now: another lookup finds them without discovering anything.
        assert a.lookup(keys) == 8 and a.stats()["redis"]["discovered"] == 8
        stored = [e for e in a.take_events() if e.medium == "redis" and not e.removed]
        assert sorted(k for e in stored for k in e.keys) == sorted(keys)


def test_discovery_stops_at_corrupt_foreign_or_missing_headers(server) -> None:
    prefix = unique_prefix("live")
    keys = keys_for(5)
    t = open_tier(server, capacity=16, prefix=prefix)
    other = open_tier(server, capacity=16, prefix=prefix)
    foreign = open_tier(server, capacity=16, prefix=prefix, namespace="another/model")
    try:
        assert t.probe(keys) == 0
        slots = other.allocate(keys[:3])
        other.write(slots, rand_blocks(3, 4096, 2), keys[:3])
        assert t.probe(keys) == 3
        c = server.client()
        c.set(t.redis_key(keys[1]), b"garbage")
        assert t.probe(keys) == 1  # a bad header ends the run
        # The same key under another namespace lives under another Redis key: not found.
        fslots = foreign.allocate(keys[3:4])
        foreign.write(fslots, rand_blocks(1, 4096, 3), keys[3:4])
        assert t.probe(keys[3:]) == 0
        adopted = t.adopt(keys[:1])
        assert adopted is not None and len(adopted) == 1
        assert t.free_blocks == 15
    finally:
        for x in (t, other, foreign):
            x.close()


def test_evicting_discovered_blocks_never_deletes_them(server) -> None:
    prefix = unique_prefix("live")
    small = {"tiers": [{"kind": "redis", "blocks": 4, "url": server.url, "prefix": prefix}]}
    big = {"tiers": [{"kind": "redis", "blocks": 16, "url": server.url, "prefix": prefix}]}
    keys, data = keys_for(8), rand_blocks(8, 4096, 8)
    with TierCache.open(small, block_bytes=4096) as reader:
        with TierCache.open(big, block_bytes=4096) as writer:
            writer.put(keys, data)
        assert reader.lookup(keys[:4]) == 4 and reader.lookup(keys[4:]) == 4
    # The reader evicted (and flushed at close) the first four: they are still in Redis.
    with TierCache.open(big, block_bytes=4096) as cache:
        assert cache.lookup(keys) == 8 and torch.equal(cache.get(keys), data)


def test_discovery_in_a_full_last_tier_evicts_to_make_room(server) -> None:
    prefix = unique_prefix("live")
    cfg = {"tiers": [{"kind": "redis", "blocks": 4, "url": server.url, "prefix": prefix}]}
    old, new = keys_for(8)[:4], keys_for(8)[4:]
    with TierCache.open(cfg, block_bytes=4096) as a:
        a.put(old, rand_blocks(4, 4096, 5))
        with TierCache.open(cfg, block_bytes=4096) as b:
            b.put(new[:2], rand_blocks(2, 4096, 6))
        assert a.lookup(new) == 2  # 2 of a's own blocks were evicted to index them
        assert a.stats()["redis"]["used_blocks"] == 4
        assert a.stats()["redis"]["discovered"] == 2


def test_discovery_while_redis_is_down_is_a_plain_miss(tmp_path) -> None:
    srv = RedisServer(tmp_path / "d")
    try:
        t = open_tier(srv)
        srv.kill()
        assert t.probe(keys_for(3)) == 0
        t.close()
    finally:
        srv.kill()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"not json", "unreadable tiercache metadata"),
        (b'{"format": "other"}', "does not describe a tiercache Redis store"),
        (b'{"format": "tiercache-redis", "version": 999}', "format version 999"),
    ],
)
def test_foreign_or_newer_store_meta_is_refused_naming_the_prefix(server, value, message) -> None:
    """The store's metadata key is checked by the one store-meta rule (`store_dir.MetaFormat`):
    a foreign or newer store under the prefix is a ConfigError on `prefix`, and its key is
    left as it was."""
    from tiercache.tiers.redis.client import META_SUFFIX, STORE_FORMAT

    prefix, namespace = unique_prefix("meta"), "model/bf16"
    value = value.replace(b"tiercache-redis", STORE_FORMAT.encode())
    client = redis.Redis.from_url(server.url)
    meta_key = (prefix + namespace).encode() + META_SUFFIX
    client.set(meta_key, value)
    with pytest.raises(ConfigError, match=message) as exc:
        open_tier(server, prefix=prefix, namespace=namespace)
    assert exc.value.field.endswith("prefix")
    assert "choose another prefix" in str(exc.value) or message.startswith("unreadable")
    assert client.get(meta_key) == value


def _clients(observer: redis.Redis) -> int:
    """Connections the server holds open, the observer's own left out."""
    return len(observer.client_list()) - 1


def test_close_and_a_refused_open_leave_no_connection_open(server) -> None:
    # The tier builds its client on a pool of its own, which `Redis.close` alone leaves
    # connected: its sockets stayed open until the garbage collector found them.
    import gc

    observer = server.client()
    try:
        gc.collect()  # other tests' tiers, dropped without close
        before = _clients(observer)
        prefix = unique_prefix("close")
        t = open_tier(server, block_bytes=256, prefix=prefix)
        keys = keys_for(4, 3)
        t.write(t.allocate(keys), rand_blocks(4, 256, 2), keys)
        assert _clients(observer) > before
        t.close()
        assert _clients(observer) <= before
        # A store under this prefix with another block size: refused, and nothing stays open.
        with pytest.raises(ConfigError, match="block_bytes"):
            open_tier(server, block_bytes=512, prefix=prefix)
        assert _clients(observer) <= before
    finally:
        observer.close()
