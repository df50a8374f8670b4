"""`tiercache inspect`, `verify`, `evict` and `clear` on real NVMe and LMDB stores built here,
including stores another process holds open."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
import torch
from click.testing import CliRunner

from tiercache.cli import main
from tiercache.tiers.format import HEADER_SIZE, namespace_id
from tiercache.tiers.lmdb import LMDBTier, store_key
from tiercache.tiers.nvme import NVMeTier

BB = 4096  # block bytes


def keys_for(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def blocks_for(keys: list[bytes]) -> torch.Tensor:
    """Compressible, key-dependent bytes (bf16-like: a varying low byte, a constant high one)."""
    out = torch.zeros((len(keys), BB), dtype=torch.uint8)
    for i, k in enumerate(keys):
        g = torch.Generator().manual_seed(int.from_bytes(k[:8], "little"))
        out[i, 0::2] = torch.randint(0, 256, (BB // 2,), generator=g, dtype=torch.uint8)
        out[i, 1::2] = 0x3F
    return out


def fill(tier: NVMeTier | LMDBTier, keys: list[bytes]) -> None:
    slots = tier.allocate(keys)
    assert slots is not None
    tier.write(slots, blocks_for(keys), keys)


def make_nvme(path: Path, n: int = 12, ns: str = "ns-a", cap: int = 32) -> list[bytes]:
    keys = keys_for(f"nvme/{ns}", n)
    t = NVMeTier(block_bytes=BB, capacity_blocks=cap, path=path, namespace=ns, direct=False)
    try:
        fill(t, keys)
    finally:
        t.close()
    return keys


def make_lmdb(path: Path, n: int = 12, ns: str = "ns-a", cap: int = 64) -> list[bytes]:
    keys = keys_for(f"lmdb/{ns}", n)
    t = LMDBTier(block_bytes=BB, capacity_blocks=cap, path=str(path), namespace=ns)
    try:
        fill(t, keys)
    finally:
        t.close()
    return keys


def snapshot(path: Path) -> dict[str, tuple[str, int]]:
    """Content hash and mtime of every file of a store (LMDB's reader table excluded)."""
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(path.iterdir())
        if p.name != "lock.mdb"
    }


def run(*args: str, input: str | None = None) -> object:
    return CliRunner().invoke(main, [*args], input=input)


def read_back(path: Path, kind: str, keys: list[bytes], ns: str = "ns-a") -> list[bool]:
    """Reopen the store as a tier; for each key whether it is held with the right bytes."""
    if kind == "nvme":
        t = NVMeTier(block_bytes=BB, capacity_blocks=32, path=path, direct=False, namespace=ns)
    else:
        t = LMDBTier(block_bytes=BB, capacity_blocks=64, path=str(path), namespace=ns)
    try:
        held = dict(t.recover())
        out = []
        for k in keys:
            if k not in held:
                out.append(False)
                continue
            dst = torch.empty((1, BB), dtype=torch.uint8)
            failed = t.read([held[k]], dst, [k])
            out.append(not failed and torch.equal(dst[0], blocks_for([k])[0]))
        return out
    finally:
        t.close()


# -- inspect ---------------------------------------------------------------------------------


def test_inspect_offline_reports_and_modifies_nothing(tmp_path: Path) -> None:
    make_nvme(tmp_path / "nvme", 12)
    make_lmdb(tmp_path / "lmdb", 9)
    before = {k: snapshot(tmp_path / k) for k in ("nvme", "lmdb")}
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        textwrap.dedent(f"""
        namespace = "ns-a"
        [[tiers]]
        kind = "cpu"
        blocks = 8
        [[tiers]]
        kind = "nvme"
        path = "{tmp_path / "nvme"}"
        blocks = 32
        [[tiers]]
        kind = "lmdb"
        path = "{tmp_path / "lmdb"}"
        blocks = 64
        """)
    )
    r = run("inspect", str(cfg), "--json")
    assert r.exit_code == 0, r.output
    tiers = {t["name"]: t for t in json.loads(r.stdout)["tiers"]}
    assert tiers["cpu"]["note"].startswith("volatile")
    nv, lm = tiers["nvme"], tiers["lmdb"]
    assert (nv["blocks"], nv["capacity_blocks"], nv["block_bytes"]) == (12, 32, BB)
    assert nv["namespaces"] == {"ns-a": 12} and nv["compression_ratio"] == 1.0
    assert (nv["oldest_seq"], nv["newest_seq"]) == (1, 12)
    assert nv["in_use"] is False and nv["unreadable_entries"] == 0
    assert nv["format"].startswith("tiercache-nvme v1")
    assert (lm["blocks"], lm["capacity_blocks"]) == (9, 64)
    assert lm["raw_bytes"] == 9 * BB and lm["compression_ratio"] > 1.3  # zstd on bf16-like
    assert lm["namespaces"] == {"ns-a": 9} and lm["in_use"] is False
    # The human form names the same facts.
    r = run("inspect", str(tmp_path / "lmdb"))
    assert r.exit_code == 0, r.output
    # No config: the store names its namespace and its capacity (recorded at open).
    assert "ns-a: 9 of 64 blocks" in r.output and "id:" not in r.output
    r = run("inspect", str(tmp_path / "lmdb"), "--namespace", "ns-a")
    assert "ns-a: 9" in r.output
    assert {k: snapshot(tmp_path / k) for k in ("nvme", "lmdb")} == before


HOLDER = """
import sys, torch
from tiercache import TierCache
cfg = {"namespace": "live", "tiers": [
    {"kind": "nvme", "path": sys.argv[1], "blocks": 32, "direct": False},
    {"kind": "lmdb", "path": sys.argv[2], "blocks": 64}]}
with TierCache.open(cfg, block_bytes=4096) as c:
    keys = c.hash_tokens(list(range(16 * 10)))
    c.put(keys, torch.full((10, 4096), 7, dtype=torch.uint8))
    c.tiers[1].write(c.tiers[1].allocate(keys[:4]), torch.full((4, 4096), 9,
                     dtype=torch.uint8), keys[:4])
    c.flush()
    print("ready", flush=True)
    sys.stdin.readline()
"""


def test_inspect_and_verify_a_store_another_process_holds(tmp_path: Path) -> None:
    nvme, lmdb_dir = tmp_path / "nvme", tmp_path / "lmdb"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(nvme), str(lmdb_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        before = {p: snapshot(p) for p in (nvme, lmdb_dir)}
        r = run("inspect", str(nvme), "--json", "--namespace", "live")
        assert r.exit_code == 0, r.output
        (nv,) = json.loads(r.stdout)["tiers"]
        assert nv["in_use"] is True and nv["blocks"] == 10 and nv["namespaces"] == {"live": 10}
        assert nv["holder_pid"] == child.pid
        r = run("inspect", str(lmdb_dir), "--json", "--namespace", "live")
        assert r.exit_code == 0, r.output
        (lm,) = json.loads(r.stdout)["tiers"]
        assert lm["in_use"] is True and lm["holder_pid"] == child.pid
        assert lm["blocks"] == 4 and lm["namespaces"] == {"live": 4}
        # verify is read-only too, and finds the live stores clean.
        for p in (nvme, lmdb_dir):
            r = run("verify", str(p), "--json", "--no-progress")
            assert r.exit_code == 0, r.output
            assert json.loads(r.stdout)["ok"] is True
        # Changing an NVMe store needs its owner gone: a one-line error, nothing asked.
        r = run("clear", str(nvme), "--yes")
        assert r.exit_code == 2
        assert r.output.strip() == (
            f"tiercache: error: {nvme} is open in another process; stop it before changing "
            "the store"
        )
        assert {p: snapshot(p) for p in (nvme, lmdb_dir)} == before
    finally:
        child.communicate("\n", timeout=60)
    assert child.returncode == 0


def test_inspect_lmdb_open_in_this_process_borrows_its_environment(tmp_path: Path) -> None:
    store = tmp_path / "lmdb"
    keys = keys_for("same-process", 6)
    t = LMDBTier(block_bytes=BB, capacity_blocks=64, path=str(store), namespace="ns-a")
    try:
        fill(t, keys[:3])
        r = run("inspect", str(store), "--json")
        assert r.exit_code == 0, r.output
        (info,) = json.loads(r.stdout)["tiers"]
        assert info["blocks"] == 3 and info["holder_pid"] == os.getpid()
        assert run("verify", str(store), "--no-progress").exit_code == 0
        fill(t, keys[3:])  # the tier's environment is still open and usable
    finally:
        t.close()
    assert read_back(store, "lmdb", keys) == [True] * 6


# -- verify ----------------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_verify_nvme_finds_and_repairs_corruption(tmp_path: Path) -> None:
    store = tmp_path / "nvme"
    keys = make_nvme(store, 10)
    r = run("verify", str(store), "--no-progress")
    assert r.exit_code == 0, r.output
    assert "ok" in r.output and "10 blocks checked" in r.output
    slot_bytes = json.loads((store / "meta.json").read_text())["slot_bytes"]
    _flip(store / "slab", 3 * slot_bytes + HEADER_SIZE + 100)  # payload of slot 3
    _flip(store / "slab", 5 * slot_bytes + 10)  # the key in slot 5's header
    _flip(store / "index", 40 * 7 + 3)  # record 7: slot 6's PUT (record 0 is the BASE)
    r = run("verify", str(store), "--json", "--no-progress")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    (st,) = doc["stores"]
    found = {p["where"]: p["what"] for p in st["problems"]}
    assert found["slot 3"] == "checksum mismatch"
    assert "slot 5" in found
    assert found["index"] == "1 damaged journal records"
    # Slot 6's block is no longer indexed, so not checked.
    assert st["checked"] == 9
    r = run("verify", str(store))
    assert r.exit_code == 1 and "--repair" in r.output and "checksum mismatch" in r.output
    r = run("verify", str(store), "--repair", "--json", "--no-progress")
    assert r.exit_code == 0, r.output
    (st,) = json.loads(r.stdout)["stores"]
    assert st["ok"] and st["dropped"] == 2 and st["checked"] == 7
    good = read_back(store, "nvme", keys)
    assert good == [i not in (3, 5, 6) for i in range(10)]


def test_verify_lmdb_finds_and_repairs_corruption(tmp_path: Path) -> None:
    store = tmp_path / "lmdb"
    keys = make_lmdb(store, 10)
    sk = [store_key(namespace_id("ns-a"), k) for k in keys]  # the LMDB keys
    env = lmdb.open(str(store), max_dbs=3, map_size=0)
    heads, blocks = env.open_db(b"heads"), env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        v = bytearray(txn.get(sk[2], db=blocks))
        v[len(v) // 2] ^= 1
        txn.put(sk[2], bytes(v), db=blocks)  # a flipped payload byte
        txn.delete(sk[4], db=heads)  # a payload without its header
        txn.delete(sk[6], db=blocks)  # a header without its payload
        h = bytearray(txn.get(sk[8], db=heads))
        h[30] ^= 1  # the namespace id, covered by the checksum
        txn.put(sk[8], bytes(h), db=heads)
    env.close()
    r = run("verify", str(store), "--json", "--no-progress")
    assert r.exit_code == 1, r.output
    (st,) = json.loads(r.stdout)["stores"]
    found = {p["key"]: p["what"] for p in st["problems"]}
    assert found == {
        keys[2].hex(): "checksum mismatch",
        keys[4].hex(): "payload without a header (orphan)",
        keys[6].hex(): "header without a payload",
        keys[8].hex(): "checksum mismatch",
    }
    assert st["checked"] == 9  # every header
    r = run("verify", str(store), "--repair", "--no-progress")
    assert r.exit_code == 0, r.output
    assert "4 bad entries dropped" in r.output
    assert read_back(store, "lmdb", keys) == [i not in (2, 4, 6, 8) for i in range(10)]


# -- evict and clear ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_evict_oldest_asks_first_and_keeps_the_newest(tmp_path: Path, kind: str) -> None:
    store = tmp_path / kind
    keys = (make_nvme if kind == "nvme" else make_lmdb)(store, 10)
    before = snapshot(store)
    r = run("evict", str(store), "--oldest", "4", input="n\n")
    assert r.exit_code == 1 and "evict 4 of 10 blocks" in r.output and "Aborted" in r.output
    assert snapshot(store) == before  # answered no: nothing changed
    r = run("evict", str(store), "--oldest", "4", input="y\n")
    assert r.exit_code == 0, r.output
    assert f"{kind}: 4 blocks dropped" in r.output
    assert read_back(store, kind, keys) == [i >= 4 for i in range(10)]
    r = run("evict", str(store), "--keep", "2", "--yes", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"dropped": {kind: 4}}
    assert read_back(store, kind, keys) == [i >= 8 for i in range(10)]
    r = run("evict", str(store), "--key", keys[9].hex(), "--yes")
    assert r.exit_code == 0, r.output
    assert read_back(store, kind, keys) == [i == 8 for i in range(10)]


@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_clear_by_namespace(tmp_path: Path, kind: str) -> None:
    store = tmp_path / kind
    make = make_nvme if kind == "nvme" else make_lmdb
    a = make(store, 6, ns="tenant-a")
    b = keys_for(f"{kind}/tenant-b", 5)
    # A second engine with another namespace writes into the same store.
    if kind == "nvme":
        t: NVMeTier | LMDBTier = NVMeTier(
            block_bytes=BB, capacity_blocks=32, path=store, namespace="tenant-b", direct=False
        )
    else:
        t = LMDBTier(block_bytes=BB, capacity_blocks=64, path=str(store), namespace="tenant-b")
    t.recover()
    fill(t, b)
    t.close()
    r = run("inspect", str(store), "--json", "--namespace", "tenant-a")
    (info,) = json.loads(r.stdout)["tiers"]
    # NVMe keeps only namespace ids; an LMDB store records the names of its namespaces.
    b_label = "tenant-b" if kind == "lmdb" else f"id:{namespace_id('tenant-b'):016x}"
    assert info["namespaces"] == {"tenant-a": 6, b_label: 5}
    r = run("clear", str(store), "--namespace", "tenant-b", input="y\n")
    assert r.exit_code == 0, r.output
    assert "clear 5 of 11 blocks" in r.output
    assert read_back(store, kind, a, ns="tenant-a") == [True] * 6
    assert read_back(store, kind, b, ns="tenant-b") == [False] * 5
    r = run("clear", str(store), "--namespace", f"id:{namespace_id('tenant-a'):016x}", "--yes")
    assert r.exit_code == 0, r.output
    r = run("clear", str(store), "--yes")
    assert r.exit_code == 0 and "nothing to clear" in r.output
    assert not any(read_back(store, kind, a, ns="tenant-a"))


def test_evict_and_clear_through_a_config(tmp_path: Path) -> None:
    make_nvme(tmp_path / "nvme", 6)
    make_lmdb(tmp_path / "lmdb", 7)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'namespace = "ns-a"\n[[tiers]]\nkind = "nvme"\npath = "{tmp_path / "nvme"}"\n'
        f'blocks = 32\n[[tiers]]\nkind = "lmdb"\nname = "disk"\npath = "{tmp_path / "lmdb"}"\n'
        "blocks = 64\n"
    )
    r = run("clear", str(cfg), "--tier", "disk", "--yes", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"dropped": {"disk": 7}}
    r = run("clear", str(cfg), "--namespace", "ns-a", "--yes", "--json")
    assert json.loads(r.stdout) == {"dropped": {"nvme": 6, "disk": 0}}


# -- errors and help ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "{tmp}/missing"], "{tmp}/missing: no such file or directory"),
        (["verify", "{tmp}"], "is not a tiercache store or telemetry directory"),
        (["evict", "{tmp}/lmdb"], "give exactly one of --oldest N, --keep N or --key HEX"),
        (["evict", "{tmp}/lmdb", "--key", "abc"], "--key: 'abc' is not a block key"),
        (["clear", "{tmp}/lmdb", "--namespace", "id:zz"], "expected 'id:' and 16 hex digits"),
        (["clear", "{tmp}/c.toml", "--tier", "tape"], "--tier: no tier named 'tape'"),
        (["stats", "{tmp}/c.toml"], "no telemetry configured and no persistent tier"),
        (["events", "{tmp}/lmdb"], "no telemetry directory"),
        (["inspect", "{tmp}/bad.toml"], "tiers[0].blocks: must be >= 1"),
    ],
)
def test_errors_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    make_lmdb(tmp_path / "lmdb", 2)
    (tmp_path / "c.toml").write_text('[[tiers]]\nkind = "cpu"\nblocks = 4\n')
    (tmp_path / "bad.toml").write_text('[[tiers]]\nkind = "cpu"\nblocks = 0\n')
    os.mkdir(tmp_path / "empty")
    r = run(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert r.exit_code == 2, r.output
    (line,) = r.output.strip().splitlines()
    assert line.startswith("tiercache: error: ")
    assert message.replace("{tmp}", str(tmp_path)) in line


def test_damaged_lmdb_metadata_is_one_line(tmp_path: Path) -> None:
    store = tmp_path / "lmdb"
    make_lmdb(store, 2)
    env = lmdb.open(str(store), max_dbs=3, map_size=0)
    with env.begin(write=True) as txn:
        txn.put(b"store", b"{not json", db=env.open_db(b"meta", txn=txn))
    env.close()
    r = run("inspect", str(store))
    assert r.exit_code == 2
    assert r.output.strip() == f"tiercache: error: path: {store}: unreadable tiercache metadata"


@pytest.mark.parametrize("cmd", ["inspect", "verify", "stats", "events", "evict", "clear"])
def test_every_command_has_help_with_an_example(cmd: str) -> None:
    r = run(cmd, "--help")
    assert r.exit_code == 0
    assert "Example" in r.output and f"tiercache {cmd} " in r.output
    assert "CONFIG_OR_PATH" in r.output
