"""`tiers/lmdb/warm.py`: the index warm pass asks for exactly the B-tree pages (branch and
leaf) of the databases named, never the payloads, and maps them into this process's map of
the store where it has one; a lazy open starts it; `will_need` takes any value."""

from __future__ import annotations

import ctypes
import os
import time

import lmdb
import torch

from tests.tier_conformance import keys_for, rand_blocks
from tiercache.tiers.lmdb import LMDBTier
from tiercache.tiers.lmdb import warm as lmdb_warm
from tiercache.tiers.lmdb.layout import HEADS_DB, ORDER_DB


def fill(path: str, n: int, block_bytes: int = 4096, **kw: object) -> LMDBTier:
    tier = LMDBTier(path=path, block_bytes=block_bytes, capacity_blocks=n, **kw)
    for s in range(0, n, 256):
        keys = keys_for(min(256, n - s), s)
        tier.write(tier.allocate(keys), rand_blocks(len(keys), block_bytes, seed=s), keys)
    return tier


def tree_pages(tier: LMDBTier) -> dict[str, int]:
    sh = tier._shared
    with sh.env.begin() as txn:
        return {
            name: st["branch_pages"] + st["leaf_pages"]
            for name, st in (
                ("heads", txn.stat(sh.heads)),
                ("order", txn.stat(sh.order)),
                ("blocks", txn.stat(sh.blocks)),
            )
        }


def test_warm_asks_for_the_index_pages_only(tmp_path):
    # Raw 4 KiB payloads: each in overflow pages of "blocks", which the pass must not visit.
    tier = fill(str(tmp_path / "s"), 3000, compression="none")
    want = tree_pages(tier)
    tier.close()
    got = lmdb_warm.warm_index(str(tmp_path / "s"), (HEADS_DB, ORDER_DB))
    assert want["heads"] > 10  # a tree of several levels, not a single leaf
    assert got["pages"] == want["heads"] + want["order"]
    # Asking for "blocks" too counts its branch and leaf pages, never its overflow pages.
    got = lmdb_warm.warm_index(str(tmp_path / "s"), (HEADS_DB, ORDER_DB, b"blocks"))
    assert got["pages"] == sum(want.values())


def populate_read() -> bool:
    """Whether this kernel has MADV_POPULATE_READ (5.14)."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (5, 14)


def test_warm_maps_the_pages_it_asks_for_where_this_process_maps_the_store(tmp_path):
    path = str(tmp_path / "s")
    tier = fill(path, 3000, compression="none")
    try:
        data = os.path.join(path, "data.mdb")
        base = lmdb_warm.map_base(data)
        assert base is not None  # LMDB's map of the file, from its first byte
        with open(data, "rb") as f:
            assert ctypes.string_at(base, 4096) == f.read(4096)
        got = lmdb_warm.warm_index(path, (HEADS_DB, ORDER_DB))
        want = tree_pages(tier)
        assert got["pages"] == want["heads"] + want["order"]
        assert got["mapped"] == (got["pages"] if populate_read() else 0)
    finally:
        tier.close()
    # No map of it in this process once closed: asked for, not mapped.
    assert lmdb_warm.map_base(os.path.join(path, "data.mdb")) is None
    got = lmdb_warm.warm_index(path, (HEADS_DB, ORDER_DB))
    assert got["pages"] > 10 and got["mapped"] == 0


def test_warm_of_a_missing_or_empty_database_is_a_no_op(tmp_path):
    LMDBTier(path=str(tmp_path / "s"), block_bytes=4096, capacity_blocks=8).close()
    assert lmdb_warm.warm_index(str(tmp_path / "s"), (HEADS_DB, b"nope"))["pages"] == 0


def test_warm_stops_quietly_on_a_file_that_is_not_lmdb(tmp_path):
    (tmp_path / "data.mdb").write_bytes(os.urandom(3 * 4096))
    assert lmdb_warm.warm_index(str(tmp_path), (HEADS_DB,))["pages"] == 0


def test_lazy_open_warms_in_the_background(tmp_path):
    path = str(tmp_path / "s")
    fill(path, 600).close()
    tier = LMDBTier(path=path, block_bytes=4096, capacity_blocks=600, lazy=True)
    try:
        deadline = time.monotonic() + 10
        while "index_warm_pages" not in tier.stats() and time.monotonic() < deadline:
            time.sleep(0.01)
        st = tier.stats()
        assert st["index_warm_pages"] > 0
        assert st["index_warm_mapped"] == (st["index_warm_pages"] if populate_read() else 0)
        assert tier.probe(keys_for(16)) == 16
    finally:
        tier.close()


def test_will_need_accepts_small_and_large_values(tmp_path):
    env = lmdb.open(str(tmp_path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"a", b"x" * 10)
        txn.put(b"b", os.urandom(5 * 4096))
    with env.begin(buffers=True) as txn:
        views = [txn.get(b"a"), txn.get(b"b")]
        lmdb_warm.will_need(views)
        assert bytes(views[0]) == b"x" * 10
    env.close()
    lmdb_warm.will_need([memoryview(torch.zeros(3 * 4096, dtype=torch.uint8).numpy())])
