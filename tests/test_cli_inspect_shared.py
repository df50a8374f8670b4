"""`tiercache inspect` on a shared LMDB store (issue 15, item 5): per-namespace usage and
capacity, who is attached (the store's attach entries and LMDB's reader table), from a
process of its own while writers hold the store, changing nothing; and on a Redis tier: the
server's cheap facts, keys per namespace only with --redis-scan."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch
from click.testing import CliRunner

from tests.campaign_support import repo_env
from tests.test_cli_store import BB, snapshot
from tests.test_tier_redis import RedisServer, require_redis
from tiercache.cli import main
from tiercache.tiers.format import namespace_id
from tiercache.tiers.lmdb import LMDBTier, open_store
from tiercache.tiers.lmdb.attach import ATTACH_PREFIX, CAPACITY_PREFIX, NAME_PREFIX
from tiercache.tiers.redis import RedisTier

REPO = Path(__file__).resolve().parents[1]

# A writer: opens the store with its namespace and capacity, stores N <= capacity blocks,
# says "ready", then closes and exits ("close") or waits for a line on stdin first ("hold";
# "read": inside a read transaction).
WRITER = """
import hashlib, sys, torch
from tiercache.tiers.lmdb import LMDBTier
path, ns, cap, n, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
t = LMDBTier(block_bytes=4096, capacity_blocks=cap, path=path, namespace=ns)
keys = [hashlib.blake2b(f"{ns}/{i}".encode(), digest_size=16).digest() for i in range(n)]
t.write(t.allocate(keys), torch.full((n, 4096), 5, dtype=torch.uint8), keys)
t.flush()
txn = t._shared.env.begin() if mode == "read" else None  # a read txn held open
print("ready", flush=True)
if mode != "close":
    sys.stdin.readline()
if txn is not None:
    txn.abort()
t.close()
"""


def env() -> dict[str, str]:
    return repo_env()


def writer(path: Path, ns: str, cap: int, n: int, mode: str) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), ns, str(cap), str(n), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env(),
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def inspect_json(*args: str) -> dict:
    """`tiercache inspect --json` in this process: a third one beside the writers."""
    r = CliRunner().invoke(main, ["inspect", *args, "--json"])
    assert r.exit_code == 0, r.output
    (tier,) = json.loads(r.stdout)["tiers"]
    return tier


def test_inspect_shows_namespaces_capacity_and_who_is_attached(tmp_path: Path) -> None:
    store = tmp_path / "lmdb"
    # Writer A (namespace "tenant-a", capacity 16) stores 12 blocks and exits.
    a = writer(store, "tenant-a", 16, 12, "close")
    assert a.wait(timeout=60) == 0
    # Writer B (namespace "tenant-b", capacity 8) stores 8 blocks and keeps the store open,
    # inside a read transaction.
    b = writer(store, "tenant-b", 8, 8, "read")
    try:
        before = snapshot(store)
        info = inspect_json(str(store))
        # Every namespace is named (the store records names) with its blocks and capacity.
        assert info["namespaces"] == {"tenant-a": 12, "tenant-b": 8}
        usage = {u["namespace"]: u for u in info["namespace_usage"]}
        assert usage["tenant-a"] == {
            "namespace": "tenant-a",
            "id": f"{namespace_id('tenant-a'):016x}",
            "blocks": 12,
            "counted": 12,
            "capacity_blocks": 16,
            "used": 12 / 16,
            "attached": 0,
        }
        assert usage["tenant-b"]["blocks"] == usage["tenant-b"]["counted"] == 8
        assert usage["tenant-b"]["capacity_blocks"] == 8 and usage["tenant-b"]["attached"] == 1
        # A closed its tier: only B is attached, live, with its pid; B's open read txn is in
        # LMDB's reader table, with the snapshot it reads; the inspecting process is not.
        (att,) = info["attached"]
        assert (att["pid"], att["namespace"], att["state"]) == (b.pid, "tenant-b", "live")
        assert att["capacity_blocks"] == 8 and att["host"] == os.uname().nodename
        (rd,) = info["readers"]
        assert rd["pid"] == b.pid and isinstance(rd["txn"], int)
        assert info["in_use"] is True and info["holder_pid"] == b.pid
        # The human form says the same.
        r = CliRunner().invoke(main, ["inspect", str(store)])
        assert r.exit_code == 0, r.output
        assert "tenant-a: 12 of 16 blocks (75.0%)" in r.output
        assert "tenant-b: 8 of 8 blocks (100.0%), 1 attached" in r.output
        assert f"pid {b.pid} on" in r.output and "per namespace (below)" in r.output
        # Inspection is read-only: the data file is byte for byte what it was.
        assert snapshot(store) == before
    finally:
        b.communicate("\n", timeout=60)
    assert b.returncode == 0
    assert inspect_json(str(store))["attached"] == []  # B's close removed its entry


def test_a_killed_writer_shows_stale_and_the_next_open_prunes_it(tmp_path: Path) -> None:
    store = tmp_path / "lmdb"
    k = writer(store, "tenant-k", 16, 4, "hold")
    k.send_signal(signal.SIGKILL)
    k.wait(timeout=60)
    info = inspect_json(str(store))
    (att,) = info["attached"]
    assert (att["pid"], att["namespace"], att["state"]) == (k.pid, "tenant-k", "stale")
    assert info["in_use"] is False
    r = CliRunner().invoke(main, ["inspect", str(store)])
    assert "stale (the process is gone)" in r.output
    # A tier opening on this host deletes the stale entries of its host.
    t = LMDBTier(block_bytes=BB, capacity_blocks=16, path=str(store), namespace="tenant-k")
    try:
        info = inspect_json(str(store))
        (att,) = info["attached"]
        assert (att["pid"], att["state"]) == (os.getpid(), "live")
    finally:
        t.close()


def test_a_store_without_the_records_reads_as_unknown(tmp_path: Path) -> None:
    """A format-3 store written before capacity, names and attach entries were recorded:
    inspect shows ids and "capacity not recorded", and a tier still opens it."""
    store = tmp_path / "lmdb"
    w = writer(store, "old", 16, 5, "close")
    assert w.wait(timeout=60) == 0
    e = lmdb.open(str(store), max_dbs=4, map_size=0)
    meta = e.open_db(b"meta")
    with e.begin(write=True, db=meta) as txn:
        cur = txn.cursor()
        gone = [
            bytes(k)
            for k in cur.iternext(values=False)
            if bytes(k).startswith((CAPACITY_PREFIX, NAME_PREFIX, ATTACH_PREFIX))
        ]
        assert len(gone) == 2  # capacity and name; the attach entry went at close
        for k in gone:
            txn.delete(k)
    e.close()
    info = inspect_json(str(store))
    ns = f"id:{namespace_id('old'):016x}"
    assert info["namespaces"] == {ns: 5}
    (u,) = info["namespace_usage"]
    assert (u["namespace"], u["blocks"], u["capacity_blocks"], u["used"]) == (ns, 5, None, None)
    r = CliRunner().invoke(main, ["inspect", str(store)])
    assert f"{ns}: 5 blocks (capacity not recorded)" in r.output
    assert "unknown (give the config)" in r.output
    t = LMDBTier(block_bytes=BB, capacity_blocks=16, path=str(store), namespace="old")
    try:
        assert len(t.recover()) == 5
    finally:
        t.close()
    assert inspect_json(str(store))["namespace_usage"][0]["namespace"] == "old"


@pytest.mark.parametrize(
    "value",
    [b"not json", b"[1, 2]", b'{"pid": "1", "host": "h", "namespace_id": 1, "opened_at": 0}'],
)
def test_a_malformed_attach_entry_is_skipped(tmp_path: Path, value: bytes) -> None:
    store = tmp_path / "lmdb"
    LMDBTier(block_bytes=BB, capacity_blocks=4, path=str(store), namespace="x").close()
    with open_store(store, write=True) as h, h.env.begin(write=True) as txn:
        txn.put(ATTACH_PREFIX + b"\x00" * 16, value, db=h.meta_db)
    info = inspect_json(str(store))
    assert info["attached"] == [] and info["namespace_usage"][0]["namespace"] == "x"


# -- Redis ---------------------------------------------------------------------------------


def test_inspect_redis_is_cheap_unless_asked_to_scan(tmp_path: Path) -> None:
    require_redis()  # a skip where redis-server is missing; under CI=true a failure
    srv = RedisServer(tmp_path / "redis", "--appendonly", "no", "--maxmemory", "64mb")
    try:
        prefix = "tc-inspect:"
        tiers = [
            RedisTier(url=srv.url, block_bytes=BB, capacity_blocks=8, prefix=prefix, namespace=ns)
            for ns in ("tenant-a", "tenant-b")
        ]
        for t, n in zip(tiers, (3, 5), strict=True):
            keys = [bytes([n, i]) * 8 for i in range(n)]
            t.write(t.allocate(keys), torch.zeros((n, BB), dtype=torch.uint8), keys)
        cfg = tmp_path / "c.toml"
        cfg.write_text(
            f'namespace = "tenant-a"\n[[tiers]]\nkind = "redis"\nurl = "{srv.url}"\n'
            f'prefix = "{prefix}"\nblocks = 8\n'
        )
        client = srv.client()
        keys_before = sorted(client.keys("*"))
        r = CliRunner().invoke(main, ["inspect", str(cfg), "--json"])
        assert r.exit_code == 0, r.output
        (info,) = json.loads(r.stdout)["tiers"]
        assert info["server"]["maxmemory"] == 64 * 2**20
        assert info["keys_in_db"] == 3 + 5 + 2  # blocks and one metadata key per namespace
        assert len(info["attached"]) == 2  # the two tiers' connections, not this inspection
        assert info["store_meta"]["block_bytes"] == BB
        assert "namespaces" not in info  # no SCAN unless asked
        r = CliRunner().invoke(main, ["inspect", str(cfg), "--json", "--redis-scan"])
        (info,) = json.loads(r.stdout)["tiers"]
        assert info["namespaces"] == {"tenant-b": 5, "tenant-a": 3}
        assert info["namespaces_with_meta"] == ["tenant-a", "tenant-b"]
        r = CliRunner().invoke(main, ["inspect", str(cfg)])
        assert "tenant-b: 5 blocks" not in r.output and "--redis-scan" in r.output
        assert sorted(client.keys("*")) == keys_before  # inspection wrote nothing
        for t in tiers:
            t.close()
    finally:
        srv.kill()
