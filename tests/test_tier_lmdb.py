"""LMDB tier: the persistent conformance suite (zstd and raw), a state machine, and scenarios
on a real LMDB environment: compression, restart in a fresh process, a reader process next
to a writer process, map full, bad paths, env sharing, pending deletes, TierCache."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import weakref
from pathlib import Path

import lmdb
import pytest
import torch

from tests.persistent_conformance import PersistentTierConformance
from tests.tier_conformance import keys_for, rand_blocks, tier_state_machine
from tests.unprivileged import as_unprivileged
from tiercache import TierCache
from tiercache.config import CacheConfig
from tiercache.errors import ConfigError
from tiercache.tiers.format import HEADER_SIZE, namespace_id
from tiercache.tiers.lmdb import LMDBTier, store_key
from tiercache.tiers.lmdb import scan as lmdb_scan
from tiercache.tiers.lmdb import tier as lmdb_tier_mod
from tiercache.tiers.lmdb.layout import SEQ_BYTES

REPO = Path(__file__).resolve().parents[1]


def bf16_blocks(n: int, block_bytes: int, seed: int = 0) -> torch.Tensor:
    """KV-like payload: bf16 normals viewed as bytes (compresses ~1.4x with the shuffle)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, block_bytes // 2), generator=g).to(torch.bfloat16).view(torch.uint8)


def sk(key: bytes, namespace: str = "") -> bytes:
    """The LMDB key of block `key` of `namespace` (the tiers' default namespace is "")."""
    return store_key(namespace_id(namespace), key)


def corrupt_value(env_dir: Path, key: bytes, nbytes: int = 3) -> None:
    """Flip the last `nbytes` of a stored value, opening the environment with py-lmdb."""
    env = lmdb.open(str(env_dir), max_dbs=3, mode=0o600)
    key = sk(key)
    try:
        db = env.open_db(b"blocks", create=False)
        with env.begin(write=True, db=db) as txn:
            v = bytearray(txn.get(key))
            for i in range(1, nbytes + 1):
                v[-i] ^= 0xFF
            txn.put(key, bytes(v))
    finally:
        env.close()


class TestLMDBTier(PersistentTierConformance):
    compression = "zstd"

    def make_tier(self, capacity_blocks, block_bytes, tmp_path):
        return LMDBTier(
            path=str(tmp_path / "lmdb"),
            block_bytes=block_bytes,
            capacity_blocks=capacity_blocks,
            compression=self.compression,
        )

    def corrupt(self, tmp_path, key: bytes) -> None:
        corrupt_value(tmp_path / "lmdb", key)

    def test_flags_and_kind(self, tier) -> None:
        assert (tier.kind, tier.persistent, tier.shared) == ("lmdb", True, True)


class TestLMDBTierRaw(TestLMDBTier):
    compression = "none"


def _machine_tier(capacity: int, block_bytes: int) -> LMDBTier:
    d = tempfile.mkdtemp(prefix="tc-lmdb-sm-")
    t = LMDBTier(path=os.path.join(d, "env"), block_bytes=block_bytes, capacity_blocks=capacity)
    weakref.finalize(t, shutil.rmtree, d, True)
    return t


TestLMDBTierMachine = tier_state_machine(_machine_tier).TestCase


def open_tier(path: Path, capacity: int = 16, block_bytes: int = 4096, **kw) -> LMDBTier:
    return LMDBTier(path=str(path), block_bytes=block_bytes, capacity_blocks=capacity, **kw)


# -- compression ---------------------------------------------------------------------------


def test_zstd_bf16_round_trip_uses_fewer_bytes(tmp_path) -> None:
    bb = 64 * 1024  # big enough for the thread pool path
    t = open_tier(tmp_path / "z", capacity=8, block_bytes=bb)
    try:
        keys = keys_for(6)
        data = bf16_blocks(6, bb, seed=1)
        t.write(t.allocate(keys), data, keys)
        out = torch.empty_like(data)
        assert t.read(list(range(6)), out, keys) == []
        assert torch.equal(out, data)
        s = t.stats()
        assert s["raw_bytes"] == 6 * bb
        assert s["stored_bytes"] < s["raw_bytes"] / 1.25  # shuffled bf16: ~1.4x at level 1
        assert s["compression_ratio"] > 1.25
    finally:
        t.close()


def test_random_bytes_are_stored_raw(tmp_path) -> None:
    t = open_tier(tmp_path / "r", capacity=8)
    try:
        keys = keys_for(4)
        t.write(t.allocate(keys), rand_blocks(4, 4096, 3), keys)
        s = t.stats()
        assert s["stored_bytes"] == s["raw_bytes"] == 4 * 4096
    finally:
        t.close()
    env = lmdb.open(str(tmp_path / "r"), max_dbs=3, readonly=True, lock=False)
    with env.begin() as txn:
        payload = txn.get(sk(keys[0]), db=env.open_db(b"blocks", txn=txn, create=False))
        head = txn.get(sk(keys[0]), db=env.open_db(b"heads", txn=txn, create=False))
        assert len(payload) == 4096 and len(head) == HEADER_SIZE + SEQ_BYTES
        assert head[6] == 0  # codec byte: raw
    env.close()


def test_corrupt_compressed_block_is_a_miss(tmp_path) -> None:
    t = open_tier(tmp_path / "c", capacity=8)
    keys = keys_for(3)
    data = bf16_blocks(3, 4096, seed=2)
    t.write(t.allocate(keys), data, keys)
    assert t.stats()["stored_bytes"] < 3 * 4096
    t.close()
    corrupt_value(tmp_path / "c", keys[1], nbytes=8)
    t = open_tier(tmp_path / "c", capacity=8)
    try:
        rec = dict(t.recover())
        out = torch.empty_like(data)
        assert t.read([rec[k] for k in keys], out, keys) == [1]
        assert torch.equal(out[0], data[0]) and torch.equal(out[2], data[2])
    finally:
        t.close()


def test_value_stored_under_another_key_is_a_miss(tmp_path) -> None:
    t = open_tier(tmp_path / "m", capacity=8)
    keys = keys_for(2)
    t.write(t.allocate(keys), rand_blocks(2, 4096, 10), keys)
    env = t._shared.env  # the process's one handle (a second open here is refused)
    with env.begin(write=True) as txn:  # a valid block (header + payload), wrong key
        for db in (t._shared.heads, t._shared.blocks):
            txn.put(sk(keys[1]), txn.get(sk(keys[0]), db=db), db=db)
    out = torch.empty((2, 4096), dtype=torch.uint8)
    assert t.read([0, 1], out, keys) == [1]
    t.close()
    t = open_tier(tmp_path / "m", capacity=8)
    try:
        assert [k for k, _ in t.recover()] == keys[:1]  # and dropped at open
    finally:
        t.close()


def test_bulk_scan_indexes_what_the_entry_walk_does(tmp_path, monkeypatch) -> None:
    # A store holding more blocks than the reopening capacity, some stored twice (their
    # order seq moves): the bulk scan (arrays) and the entry-by-entry walk index the same
    # newest blocks, oldest first.
    t = open_tier(tmp_path / "b", capacity=16)
    keys = keys_for(16)
    t.write(t.allocate(keys), rand_blocks(16, 4096, 21), keys)
    t.free([0, 1, 2])  # deleted at the next write, then stored again: newest now
    t.write(t.allocate(keys[:3]), rand_blocks(3, 4096, 22), keys[:3])
    t.close()
    t = open_tier(tmp_path / "b", capacity=10)
    try:
        bulk = [k for k, _ in t.recover()]
        assert t.open_report["bulk_scan"] == 1
    finally:
        t.close()
    monkeypatch.setattr(lmdb_scan, "scan_fast", lambda txn, shared, scope: None)
    t = open_tier(tmp_path / "b", capacity=10)
    try:
        assert t.open_report["bulk_scan"] == 0
        assert [k for k, _ in t.recover()] == bulk == keys[9:] + keys[:3]
    finally:
        t.close()


def test_a_forged_header_sends_the_open_to_the_entry_walk(tmp_path) -> None:
    t = open_tier(tmp_path / "f", capacity=8)
    keys = keys_for(3)
    t.write(t.allocate(keys), rand_blocks(3, 4096, 23), keys)
    with t._shared.env.begin(write=True) as txn:  # a header whose namespace is not ours
        head = bytearray(txn.get(sk(keys[1]), db=t._shared.heads))
        head[24] ^= 1
        txn.put(sk(keys[1]), bytes(head), db=t._shared.heads)
    t.close()
    t = open_tier(tmp_path / "f", capacity=8)
    try:
        assert t.open_report["bulk_scan"] == 0 and t.open_report["blocks_dropped"] == 1
        assert [k for k, _ in t.recover()] == [keys[0], keys[2]]
    finally:
        t.close()


def test_half_written_entries_are_dropped_at_open(tmp_path) -> None:
    t = open_tier(tmp_path / "h", capacity=8)
    keys = keys_for(3)
    t.write(t.allocate(keys), rand_blocks(3, 4096, 12), keys)
    with t._shared.env.begin(write=True) as txn:  # as another program might leave them
        txn.delete(sk(keys[0]), db=t._shared.heads)  # a payload without its header
        txn.delete(sk(keys[1]), db=t._shared.blocks)  # a header without its payload
    t.close()
    t = open_tier(tmp_path / "h", capacity=8)
    try:
        assert [k for k, _ in t.recover()] == keys[2:]
        with t._shared.env.begin() as txn:
            assert txn.get(sk(keys[0]), db=t._shared.blocks) is None
            assert txn.get(sk(keys[1]), db=t._shared.heads) is None
    finally:
        t.close()


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_truncated_payload_is_a_miss(tmp_path, compression) -> None:
    t = open_tier(tmp_path / "t", capacity=8, compression=compression)
    keys = keys_for(2)
    data = bf16_blocks(2, 4096, seed=13)
    t.write(t.allocate(keys), data, keys)
    with t._shared.env.begin(write=True, db=t._shared.blocks) as txn:
        txn.put(sk(keys[1]), txn.get(sk(keys[1]))[:-100])
    out = torch.empty_like(data)
    assert t.read([0, 1], out, keys) == [1]
    assert torch.equal(out[0], data[0])
    t.close()
    t = open_tier(tmp_path / "t", capacity=8)
    try:
        assert [k for k, _ in t.recover()] == keys[:1]  # dropped at open
    finally:
        t.close()


# -- pending deletes, sharing, recovery ----------------------------------------------------


def test_freed_block_stays_readable_until_the_next_write(tmp_path) -> None:
    t = open_tier(tmp_path / "p", capacity=4)
    try:
        keys = keys_for(4)
        data = rand_blocks(4, 4096, 4)
        slots = t.allocate(keys)
        t.write(slots, data, keys)
        t.free(slots[:2])  # eviction; a demotion planned with it reads the blocks next
        out = torch.empty((2, 4096), dtype=torch.uint8)
        assert t.read(slots[:2], out, keys[:2]) == []
        assert torch.equal(out, data[:2])
        assert t.stats()["pending_deletes"] == 2
        # keys[1] is stored again: live, so no pending delete may remove it meanwhile.
        (s1,) = t.allocate([keys[1]])
        t.flush()
        assert t.read([s1], out[:1], [keys[1]]) == []
        new = keys_for(1, 100)
        (s2,) = t.allocate(new)
        t.write([s1, s2], torch.stack([data[1], data[0]]), [keys[1], new[0]])
        assert t.read([slots[0]], out[:1], [keys[0]]) == [0]  # deleted by that write
        assert t.read([s1, s2], out, [keys[1], new[0]]) == []
        assert torch.equal(out[0], data[1]) and torch.equal(out[1], data[0])
        assert t.stats()["pending_deletes"] == 0
    finally:
        t.close()


def test_flush_applies_pending_deletes(tmp_path) -> None:
    t = open_tier(tmp_path / "f", capacity=4)
    try:
        keys = keys_for(2)
        slots = t.allocate(keys)
        t.write(slots, rand_blocks(2, 4096), keys)
        t.free(slots[:1])
        t.flush()
        out = torch.empty((1, 4096), dtype=torch.uint8)
        assert t.read(slots[:1], out, keys[:1]) == [0]
    finally:
        t.close()


def test_same_path_twice_in_one_process_shares_the_environment(tmp_path) -> None:
    a = open_tier(tmp_path / "s", capacity=8)
    b = open_tier(tmp_path / "s", capacity=8)  # vLLM's scheduler + worker connectors
    try:
        keys = keys_for(3)
        data = rand_blocks(3, 4096, 5)
        a.write(a.allocate(keys), data, keys)
        out = torch.empty_like(data)
        assert b.read([0, 1, 2], out, keys) == []  # reads by key: b's slot map is irrelevant
        assert torch.equal(out, data)
        with pytest.raises(ValueError, match="block_bytes"):
            open_tier(tmp_path / "s", capacity=8, block_bytes=8192)
        a.close()
        assert b.read([0, 1, 2], out, keys) == []  # the environment stays open for b
    finally:
        a.close()
        b.close()
    c = open_tier(tmp_path / "s", capacity=8)  # fully closed: reopening works
    assert len(c.recover()) == 3
    c.close()


def test_reopen_with_smaller_capacity_deletes_nothing_until_it_stores(tmp_path, caplog) -> None:
    t = open_tier(tmp_path / "x", capacity=8)
    keys = keys_for(8)[::-1]  # written in descending key order: age is not key order
    for i, k in enumerate(keys):
        t.write(t.allocate([k]), rand_blocks(1, 4096, i), [k])
    t.close()
    # 1. A smaller opener indexes the newest 5 and deletes nothing, even at close.
    with caplog.at_level(logging.WARNING, logger="tiercache.tiers.lmdb"):
        t = open_tier(tmp_path / "x", capacity=5)
    try:
        assert [k for k, _ in t.recover()] == keys[3:]
        assert t.used_blocks == 5 and t.allocate(keys_for(1, 50)) is None
        assert "the store evicts the 3 oldest at its next write" in caplog.text
        assert t.open_report["blocks_over_capacity"] == 3
    finally:
        t.close()
    t = open_tier(tmp_path / "x", capacity=8)
    assert len(t.recover()) == 8  # all there
    t.close()
    # 2. Its first store trims the namespace to its capacity, oldest first; the block it
    #    freed to make room was found at open, so it was only forgotten, and goes with them.
    t = open_tier(tmp_path / "x", capacity=5)
    try:
        rec = t.recover()
        t.free([rec[0][1]])  # make room, as the manager's policy would
        k = keys_for(1, 50)
        t.write(t.allocate(k), rand_blocks(1, 4096, 50), k)
    finally:
        t.close()
    t = open_tier(tmp_path / "x", capacity=8)
    assert [k for k, _ in t.recover()] == keys[4:] + keys_for(1, 50)
    t.close()


def test_blocks_of_another_namespace_are_neither_counted_nor_served(tmp_path) -> None:
    t = open_tier(tmp_path / "ns", capacity=8, namespace="model-a")
    keys = keys_for(2)
    data = rand_blocks(2, 4096, 11)
    t.write(t.allocate(keys), data, keys)
    t.close()
    t = open_tier(tmp_path / "ns", capacity=2, namespace="model-b")
    try:
        assert t.recover() == [] and t.used_blocks == 0 and t.probe(keys) == 0
        out = torch.empty((2, 4096), dtype=torch.uint8)
        assert t.read([0, 1], out, keys) == [0, 1]
        t.write(t.allocate(keys), rand_blocks(2, 4096, 12), keys)  # equal keys, side by side
    finally:
        t.close()
    t = open_tier(tmp_path / "ns", capacity=8, namespace="model-a")
    try:
        out = torch.empty((2, 4096), dtype=torch.uint8)
        assert t.read([s for _, s in t.recover()], out, keys) == []
        assert torch.equal(out, data)
    finally:
        t.close()


def test_a_store_of_format_version_1_is_refused(tmp_path) -> None:
    open_tier(tmp_path / "v1", capacity=4).close()
    env = lmdb.open(str(tmp_path / "v1"), max_dbs=3, map_size=0)
    with env.begin(write=True) as txn:
        db = env.open_db(b"meta", txn=txn)
        m = json.loads(txn.get(b"store", db=db))
        m["version"] = 1  # blocks keyed without their namespace
        txn.put(b"store", json.dumps(m).encode(), db=db)
    env.close()
    with pytest.raises(ConfigError, match="format version 1; this build reads version 4"):
        open_tier(tmp_path / "v1", capacity=4)


@pytest.mark.parametrize("sync", ["always", "never"])
def test_sync_modes_round_trip(tmp_path, sync) -> None:
    t = open_tier(tmp_path / sync, capacity=4, sync=sync)
    keys = keys_for(2)
    data = rand_blocks(2, 4096, 6)
    t.write(t.allocate(keys), data, keys)
    t.flush()
    t.close()
    t = open_tier(tmp_path / sync, capacity=4, sync=sync)
    try:
        out = torch.empty_like(data)
        assert t.read([s for _, s in t.recover()], out, keys) == []
        assert torch.equal(out, data)
    finally:
        t.close()


@pytest.mark.parametrize(
    ("sync", "interval", "expected"),
    [("batch", 1e-6, 5), ("batch", 3600.0, 0), ("never", 1e-6, 0), ("always", 1e-6, 0)],
)
def test_batch_syncs_in_the_background_at_most_once_an_interval(
    tmp_path, monkeypatch, sync, interval, expected
):
    t = open_tier(tmp_path / "bg", capacity=8, sync=sync, sync_interval=interval)
    calls = []
    monkeypatch.setattr(t._shared, "background_sync", lambda: calls.append(1))
    try:
        for i in range(5):  # 5 txns, each after the last background sync ended
            k = keys_for(1, i)
            t.write(t.allocate(k), rand_blocks(1, 4096, i), k)
            t._shared.wait_sync()
        assert len(calls) == expected
    finally:
        t.close()


def test_sync_interval_comes_from_the_config(tmp_path) -> None:
    cfg = {
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            {"kind": "lmdb", "path": str(tmp_path / "l"), "blocks": 8, "sync_interval": 0.25},
        ]
    }
    cache = TierCache.open(cfg, block_bytes=4096)
    try:
        assert cache.tiers[1]._sync_interval == 0.25
    finally:
        cache.close()
    with pytest.raises(ConfigError, match=r"^sync_interval: must be > 0"):
        open_tier(tmp_path / "bad", sync_interval=-1)


# -- processes -----------------------------------------------------------------------------

_CHILD_PRELUDE = """
import sys, time, json, torch
from tiercache.tiers.lmdb import LMDBTier
def key(i): return i.to_bytes(16, "big")
def block(i, bb):
    g = torch.Generator().manual_seed(i)
    return torch.randn((1, bb // 2), generator=g).to(torch.bfloat16).view(torch.uint8)
"""


def run_child(code: str, *args: str) -> subprocess.Popen:
    script = _CHILD_PRELUDE + textwrap.dedent(code)
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_restart_in_a_fresh_process_after_a_crash(tmp_path) -> None:
    # The child writes and acknowledges 6 blocks, then dies without flush or close.
    child = run_child(
        """
        t = LMDBTier(path=sys.argv[1], block_bytes=8192, capacity_blocks=16)
        for i in range(6):
            t.write(t.allocate([key(i)]), block(i, 8192), [key(i)])
        import os; os._exit(0)
    """,
        str(tmp_path / "env"),
    )
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    t = open_tier(tmp_path / "env", capacity=16, block_bytes=8192)
    try:
        rec = t.recover()
        assert [k for k, _ in rec] == [i.to_bytes(16, "big") for i in range(6)]
        out = torch.empty((6, 8192), dtype=torch.uint8)
        assert t.read([s for _, s in rec], out, [k for k, _ in rec]) == []
        for i in range(6):
            assert torch.equal(out[i], bf16_blocks(1, 8192, seed=i)[0])
    finally:
        t.close()


def test_reader_process_next_to_a_writer_process(tmp_path) -> None:
    # The writer cycles 64 keys through a 32-block tier (each allocation past capacity frees
    # the oldest slot, so keys are deleted and stored again all the time); the reader, another
    # process, reads random keys meanwhile: a miss or the exact bytes. Neither runs for a set
    # time (under load a process may get little CPU in it): the reader reads until it has
    # seen hits and misses and made READS reads since its first hit, then creates `done`;
    # the writer writes until `done` exists (so every read ran beside its writes) and it has
    # made WRITES writes. Each gives up after DEADLINE_S instead of waiting for ever.
    path, done = str(tmp_path / "shared"), str(tmp_path / "reader-done")
    reads, writes, deadline_s = 200, 400, 90
    writer = run_child(
        """
        import os
        bb, cap = 65536, 32
        writes, deadline_s, done = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
        data = torch.cat([block(i, bb) for i in range(64)])
        t = LMDBTier(path=sys.argv[1], block_bytes=bb, capacity_blocks=cap)
        order, slots = [], {}  # FIFO eviction, as a manager would do it
        t0 = time.monotonic(); n = 0
        while n < writes or not os.path.exists(done):
            if time.monotonic() - t0 > deadline_s:
                raise SystemExit(f"the reader was not done after {deadline_s} s ({n} writes)")
            ids = [i for i in ((n + j) % 64 for j in range(4)) if key(i) not in slots]
            n += 4
            if not ids:
                continue
            while t.free_blocks < len(ids):
                t.free([slots.pop(order.pop(0))])
            ks = [key(i) for i in ids]
            got = t.allocate(ks)
            t.write(got, data[ids], ks)
            slots.update(zip(ks, got)); order += ks
        t.close()
        print(json.dumps({"writes": n}))
    """,
        path,
        str(writes),
        str(deadline_s),
        done,
    )
    reader = run_child(
        """
        import random
        bb = 65536
        reads, deadline_s, done = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
        data = torch.cat([block(i, bb) for i in range(64)])
        # Both processes may create the store at the same moment: neither may fail.
        t = LMDBTier(path=sys.argv[1], block_bytes=bb, capacity_blocks=32)
        rnd = random.Random(0); hits = misses = after_hit = 0
        out = torch.empty((4, bb), dtype=torch.uint8)
        t0 = time.monotonic()
        while not (hits and misses and after_hit >= reads):
            if time.monotonic() - t0 > deadline_s:
                raise SystemExit(f"after {deadline_s} s: {hits} hits, {misses} misses")
            ids = rnd.sample(range(64), 4)
            failed = t.read([0, 1, 2, 3], out, [key(i) for i in ids])
            after_hit += hits > 0
            for j, i in enumerate(ids):
                if j in failed:
                    misses += 1
                elif not torch.equal(out[j], data[i]):
                    raise SystemExit(f"wrong bytes for key {i}")
                else:
                    hits += 1
        open(done, "w").close()  # the writer stops now, not before
        t.close()
        print(json.dumps({"hits": hits, "misses": misses}))
    """,
        path,
        str(reads),
        str(deadline_s),
        done,
    )
    w_out, w_err = writer.communicate(timeout=2 * deadline_s)
    r_out, r_err = reader.communicate(timeout=2 * deadline_s)
    assert writer.returncode == 0, w_err
    assert reader.returncode == 0, r_err
    assert "Error" not in r_err and "Error" not in w_err
    result = json.loads(r_out.strip().splitlines()[-1])
    assert result["hits"] > 0 and result["misses"] > 0, result
    # The keys went round the store many times: deletes and stores again beside the reads.
    assert json.loads(w_out.strip().splitlines()[-1])["writes"] >= writes


# -- faults and bad paths ------------------------------------------------------------------


def test_map_full_fails_the_write_cleanly(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(lmdb_tier_mod, "map_size_for", lambda *a, **k: 512 * 1024)
    t = open_tier(tmp_path / "full", capacity=64, block_bytes=16384, compression="none")
    try:
        keys = keys_for(4)
        data = rand_blocks(4, 16384, 7)
        t.write(t.allocate(keys), data, keys)
        big = keys_for(40, 100)
        with pytest.raises(OSError) as info:
            t.write(t.allocate(big), rand_blocks(40, 16384, 8), big)
        assert info.value.errno == errno.ENOSPC
        out = torch.empty_like(data)
        assert t.read([0, 1, 2, 3], out, keys) == []  # everything else still readable
        assert torch.equal(out, data)
    finally:
        t.close()


def test_bad_paths(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"parent directory .* does not exist"):
        open_tier(tmp_path / "missing" / "env")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a directory"):
        open_tier(tmp_path / "file")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o770)
    with pytest.raises(ConfigError, match="writable by group or others"):
        open_tier(shared)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"other.*not part of a tiercache"):
        open_tier(other)
    with pytest.raises(ConfigError, match="path"):
        LMDBTier(path="", block_bytes=64, capacity_blocks=4)


def test_unwritable_directory() -> None:
    def check(base: Path) -> None:  # as a user whose permission bits apply (not root)
        d = base / "ro"
        d.mkdir(mode=0o500)
        try:
            with pytest.raises(ConfigError, match="not readable and writable"):
                open_tier(d)
            assert os.listdir(d) == []
        finally:
            d.chmod(0o700)

    as_unprivileged(check)


def test_foreign_lmdb_environment_is_refused(tmp_path) -> None:
    d = tmp_path / "foreign"
    d.mkdir(mode=0o700)
    env = lmdb.open(str(d), mode=0o600)
    with env.begin(write=True) as txn:
        txn.put(b"user-data", b"not ours")
    env.close()
    with pytest.raises(ConfigError, match="another program"):
        open_tier(d)
    env = lmdb.open(str(d), mode=0o600)  # and it was left untouched
    with env.begin() as txn:
        assert txn.get(b"user-data") == b"not ours"
    env.close()


def test_incompatible_store_version_is_refused(tmp_path) -> None:
    open_tier(tmp_path / "v").close()
    env = lmdb.open(str(tmp_path / "v"), max_dbs=3, mode=0o600)
    meta = env.open_db(b"meta", create=False)
    with env.begin(write=True, db=meta) as txn:
        m = json.loads(txn.get(b"store"))
        m["version"] = 99
        txn.put(b"store", json.dumps(m).encode())
    env.close()
    with pytest.raises(ConfigError, match="format version 99"):
        open_tier(tmp_path / "v")


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({}, "path"),
        ({"path": "/tmp/x", "compression": "lz4"}, "compression"),
        ({"path": "/tmp/x", "level": 99}, "level"),
        ({"path": "/tmp/x", "element_size": 4}, "element_size"),
        ({"path": "/tmp/x", "sync": "sometimes"}, "sync"),
        ({"path": "/tmp/x", "fsync": "batch"}, "fsync"),
        ({"path": 3}, "path"),
    ],
)
def test_config_options_are_checked(extra, field) -> None:
    cfg = {"tiers": [{"kind": "cpu", "blocks": 4}, {"kind": "lmdb", "blocks": 8, **extra}]}
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_mapping(cfg)
    assert info.value.field == f"tiers[1].{field}"


def test_constructor_checks_settings(tmp_path) -> None:
    with pytest.raises(ConfigError, match="compression"):
        open_tier(tmp_path / "k", compression="gzip")
    with pytest.raises(ValueError, match="keys"):
        t = open_tier(tmp_path / "k")
        try:
            t.read([0], torch.empty((1, 4096), dtype=torch.uint8))
        finally:
            t.close()


# -- through TierCache ---------------------------------------------------------------------


def test_tiercache_overflow_lands_in_lmdb_and_survives_reopen(tmp_path) -> None:
    path = str(tmp_path / "cache-lmdb")

    def config(namespace: str) -> dict:
        return {
            "block_size": 4,
            "namespace": namespace,
            "tiers": [
                {"kind": "cpu", "blocks": 4},
                {"kind": "lmdb", "blocks": 64, "path": path, "write_policy": "write-back"},
            ],
        }

    tokens = list(range(48))  # 12 blocks of 4 tokens
    data = bf16_blocks(12, 4096, seed=9)
    with TierCache.open(config("t"), block_bytes=4096) as cache:
        keys = cache.hash_tokens(tokens)
        for i in range(0, 12, 4):  # each put evicts the previous 4 from the CPU tier
            assert cache.put(keys[i : i + 4], data[i : i + 4]) == 4
        stats = cache.stats()
        assert stats["cpu"]["used_blocks"] == 4 and stats["lmdb"]["used_blocks"] == 8
        assert torch.equal(cache.get(keys), data)  # 8 from LMDB, 4 from the CPU tier
    with TierCache.open(config("t"), block_bytes=4096) as cache:
        assert cache.lookup(keys) == 12  # close wrote the CPU-only blocks down
        assert torch.equal(cache.get(keys), data)
        assert cache.stats()["lmdb"]["errors"] == 0
    with TierCache.open(config("other"), block_bytes=4096) as cache:
        assert cache.lookup(cache.hash_tokens(tokens)) == 0


def test_blocks_another_process_stores_later_are_found_by_lookup(tmp_path) -> None:
    """A cache opened on a shared LMDB store before another process stored a chain finds
    that chain on its next lookup (headers checked, then adopted), and reads it verified."""

    cfg = {
        "block_size": 4,
        "namespace": "m/bf16/tp1/0",
        "tiers": [{"kind": "lmdb", "path": str(tmp_path / "env"), "blocks": 16}],
    }
    with TierCache.open(cfg, block_bytes=8192) as cache:
        keys = [i.to_bytes(16, "big") for i in range(5)]
        assert cache.lookup(keys) == 0
        child = run_child(
            """
            from tiercache import TierCache
            cfg = json.loads(sys.argv[1])
            with TierCache.open(cfg, block_bytes=8192) as c:
                c.put([key(i) for i in range(5)], torch.cat([block(i, 8192) for i in range(5)]))
            """,
            json.dumps(cfg),
        )
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert cache.lookup(keys) == 5
        want = torch.cat([_child_block(i, 8192) for i in range(5)])
        assert torch.equal(cache.get(keys), want)
        st = cache.stats()["lmdb"]
        assert st["discovered"] == 5 and st["errors"] == 0 and st["used_blocks"] == 5
        # Indexed now: the next lookup discovers nothing more.
        assert cache.lookup(keys) == 5 and cache.stats()["lmdb"]["discovered"] == 5


def _child_block(i: int, bb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn((1, bb // 2), generator=g).to(torch.bfloat16).view(torch.uint8)


def test_evicting_discovered_blocks_never_deletes_them(tmp_path) -> None:
    """Blocks a process discovered belong to the process that wrote them: when the reader's
    policy evicts them to make room, the reader forgets them but does not delete them."""

    path = str(tmp_path / "env")
    cfg = {"block_size": 4, "namespace": "m/bf16/tp1/0"}
    big = {**cfg, "tiers": [{"kind": "lmdb", "path": path, "blocks": 16}]}
    small = {**cfg, "tiers": [{"kind": "lmdb", "path": path, "blocks": 4}]}
    with TierCache.open(small, block_bytes=8192) as reader:
        child = run_child(
            """
            from tiercache import TierCache
            with TierCache.open(json.loads(sys.argv[1]), block_bytes=8192) as c:
                c.put([key(i) for i in range(8)], torch.cat([block(i, 8192) for i in range(8)]))
            """,
            json.dumps(big),
        )
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        keys = [i.to_bytes(16, "big") for i in range(8)]
        assert reader.lookup(keys[:4]) == 4
        assert reader.lookup(keys[4:]) == 4  # evicts the first four to make room
        assert reader.lookup(keys[:4]) == 4  # ... which are still there to rediscover
        assert reader.stats()["lmdb"]["discovered"] == 12
    with TierCache.open(big, block_bytes=8192) as cache:
        assert cache.lookup(keys) == 8
        assert torch.equal(cache.get(keys), torch.cat([_child_block(i, 8192) for i in range(8)]))


def test_discovery_beside_a_writer_that_keeps_evicting(tmp_path) -> None:
    """A reader cache discovers blocks while another process stores and evicts them all the
    time: every block served is exact, a block deleted after discovery is a miss, and the
    reader's accounting stays within capacity."""

    cfg = {
        "block_size": 4,
        "namespace": "m/bf16/tp1/0",
        "tiers": [{"kind": "lmdb", "path": str(tmp_path / "env"), "blocks": 24}],
    }
    writer = run_child(
        """
        from tiercache import TierCache
        cfg = json.loads(sys.argv[1])
        data = {i: block(i, 8192) for i in range(64)}
        with TierCache.open(cfg, block_bytes=8192) as c:
            t0 = time.monotonic(); n = 0
            while time.monotonic() - t0 < 3.0:
                ids = [(n + j) % 64 for j in range(4)]  # 4-block chains over 64 keys
                c.put([key(i) for i in ids], torch.cat([data[i] for i in ids]))
                n += 4
        print(json.dumps({"puts": n // 4}))
        """,
        json.dumps(cfg),
    )
    want = {i: _child_block(i, 8192) for i in range(64)}
    served = rounds = 0
    with TierCache.open(cfg, block_bytes=8192) as cache:
        t0 = time.monotonic()
        while writer.poll() is None and time.monotonic() - t0 < 60:
            rounds += 1
            start = (rounds * 4) % 64
            ids = [(start + j) % 64 for j in range(4)]
            keys = [i.to_bytes(16, "big") for i in ids]
            cache.lookup(keys)
            got = cache.get(keys)
            for row, i in zip(got, ids, strict=False):
                assert torch.equal(row, want[i][0]), f"wrong bytes for block {i}"
            served += len(got)
            st = cache.stats()["lmdb"]
            assert st["used_blocks"] <= st["capacity_blocks"]
        out, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
        st = cache.stats()["lmdb"]
        assert st["discovered"] > 0 and served > 0
    assert json.loads(out)["puts"] > 0


def test_over_capacity_at_open_counts_what_is_held_after_dropping_malformed_entries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = keys_for(6, 41)
    t = open_tier(tmp_path / "lmdb", capacity=6, block_bytes=256)
    t.write(t.allocate(keys), rand_blocks(6, 256, 4), keys)
    t.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=8, mode=0o600)
    try:  # one block loses its payload (damage): its entry is dropped at the next open
        db = env.open_db(b"blocks", create=False)
        with env.begin(write=True, db=db) as txn:
            assert txn.delete(sk(keys[0]))
    finally:
        env.close()
    with caplog.at_level(logging.WARNING, logger="tiercache"):
        t = open_tier(tmp_path / "lmdb", capacity=4, block_bytes=256)
    try:
        warned = [r.getMessage() for r in caplog.records if "capacity is 4" in r.getMessage()]
        # 6 entries, 1 malformed: 5 held, 1 over (it said "holds 6").
        assert len(warned) == 1 and "holds 5 blocks" in warned[0], warned
        assert t.open_report["blocks_dropped"] == 1
        assert t.open_report["blocks_over_capacity"] == 1
    finally:
        t.close()
