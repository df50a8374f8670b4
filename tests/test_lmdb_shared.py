"""One LMDB store shared by several processes, its capacity and eviction kept in the store:
N writers at once never push it over capacity, serve each other's blocks exactly, and a
process that opened after another stored (the order that used to delete the other's blocks)
leaves them served exactly, or plain misses where the shared capacity evicted them.

TIERCACHE_LMDB_WRITERS_SECONDS (default 15) bounds the writers' run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.campaign_children import churn, lmdb_cache_writer, lmdb_die_in_read_txn
from tests.campaign_support import (
    ChildDied,
    blocks,
    cli_verify,
    key,
    key_id,
    report,
    scale,
    served,
    start_child,
)
from tiercache import TierCache

BB, CAP = 16 * 1024, 64


def inspect(path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tiercache", "inspect", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


def test_three_writers_at_once_keep_the_store_within_capacity(tmp_path: Path) -> None:
    seconds = scale("lmdb_writers_seconds", 15)
    path = tmp_path / "fleet"
    n, per = 3, 200
    kids = [
        start_child(lmdb_cache_writer, str(path), BB, CAP, p, n, per, seconds, 40 + p)
        for p in range(n)
    ]
    got = [k.result(120 + 3 * seconds) for k in kids]
    # After every process closed, before anything reopens the store: what it holds.
    (st,) = inspect(path)["tiers"]
    figures = dict(
        seconds=seconds,
        puts=sum(g["puts"] for g in got),
        other_hits=[g["other_hits"] for g in got],
        wrong=sum(g["wrong"] for g in got),
        errors=sum(g["errors"] for g in got),
        peak=max(g["peak"] for g in got),
        final_blocks=st["blocks"],
    )
    report("lmdb-shared-writers", **figures)
    assert figures["wrong"] == 0 and figures["errors"] == 0, figures
    assert figures["peak"] <= CAP and st["blocks"] <= CAP, figures
    assert all(h > 0 for h in figures["other_hits"]), figures
    v = cli_verify(path)
    assert v is not None and v["returncode"] == 0, v


def open_cache(path: Path, namespace: str) -> TierCache:
    config = {"namespace": namespace, "tiers": [{"kind": "lmdb", "blocks": 32, "path": str(path)}]}
    return TierCache.open(config, block_bytes=BB)


def test_a_replica_that_opens_later_and_churns_leaves_plain_misses(tmp_path: Path) -> None:
    path, mine = tmp_path / "s", list(range(8))
    a = open_cache(path, "fleet")
    try:
        a.put([key(i) for i in mine], blocks(mine, BB))
        # 1. B opens after A stored (it finds A's blocks) and stores a few: within capacity,
        #    its own evictions never delete what A stored.
        tier = {"kind": "lmdb", "blocks": 32, "path": str(path)}
        assert start_child(churn, tier, BB, "fleet", list(range(100, 120))).result(120) == {
            "errors": 0
        }
        assert served(a, mine) == (8, 0, 0)
        # 2. B churns far past the capacity: the store evicts the oldest, A's blocks among
        #    them. A sees plain misses, never wrong bytes, and counts no error.
        start_child(churn, tier, BB, "fleet", list(range(200, 300))).result(120)
        exact, missed, wrong = served(a, mine)
        assert wrong == 0 and exact + missed == 8 and missed > 0
        assert a.stats()["lmdb"]["errors"] == 0
    finally:
        a.close()


def test_a_tenant_that_opens_later_and_churns_never_evicts_another(tmp_path: Path) -> None:
    path, mine = tmp_path / "t", list(range(8))
    a = open_cache(path, "tenant-a")
    try:
        a.put([key(i) for i in mine], blocks(mine, BB))
        tier = {"kind": "lmdb", "blocks": 32, "path": str(path)}
        start_child(churn, tier, BB, "tenant-b", list(range(200, 300))).result(120)
        assert served(a, mine) == (8, 0, 0)
        assert a.stats()["lmdb"]["errors"] == 0
    finally:
        a.close()


def test_a_reader_killed_in_its_transaction_does_not_fill_the_map(tmp_path: Path) -> None:
    # A process SIGKILLed inside a read transaction leaves its reader slot behind, and LMDB
    # never reuses pages freed after that snapshot: the map filled, and every later store of
    # every process failed (found by test_campaign_fleet: 596 failed stores in one run). The
    # tier now clears dead readers (reader_check) when it opens the environment and when a
    # write finds the map full.
    path = tmp_path / "s"
    tier = {"kind": "lmdb", "blocks": 32, "path": str(path)}
    assert start_child(churn, tier, BB, "fleet", list(range(8))).result(120) == {"errors": 0}
    a = open_cache(path, "fleet")  # open before the reader dies: no open clears it for us
    try:
        with pytest.raises(ChildDied):
            start_child(lmdb_die_in_read_txn, str(path), BB, 32).result(120)
        ids = list(range(100, 100 + 40 * 32))  # 40 times the capacity
        for at in range(0, len(ids), 4):
            chunk = ids[at : at + 4]
            a.put([key(i) for i in chunk], blocks(chunk, BB))
        assert a.stats()["lmdb"]["errors"] == 0
        assert served(a, ids[-8:]) == (8, 0, 0)
    finally:
        a.close()


def test_blocks_the_store_evicts_in_our_write_are_reported_removed(tmp_path: Path) -> None:
    """A block the store evicts by its capacity inside this process's write leaves the index
    and is reported removed, by key (`Tier.take_evicted`), not found gone by a later read."""

    def config(cap: int) -> dict:
        tier = {"kind": "lmdb", "blocks": cap, "path": str(tmp_path / "s"), "compression": "none"}
        return {"namespace": "ev", "tiers": [tier]}

    # The larger map first: a second open of the environment in this process may not grow it.
    with (
        TierCache.open(config(8), block_bytes=BB) as b,
        TierCache.open(config(4), block_bytes=BB) as a,
    ):
        assert a.put([key(i) for i in range(4)], blocks(range(4), BB)) == 4
        a.take_events()
        # Another instance (capacity 8) stores one more: the store holds 5 entries of "ev".
        assert b.put([key(10)], blocks([10], BB)) == 1
        # a's policy evicts its chain's tail (3) to store 11; the write deletes 3, puts 11
        # and evicts the store's oldest beyond a's capacity of 4: block 0.
        assert a.put([key(11)], blocks([11], BB)) == 1
        removed = sorted(key_id(k) for e in a.take_events() if e.removed for k in e.keys)
        assert removed == [0, 3]
        assert a.tiers[0].stats()["store_evictions"] == 1
        assert a.lookup([key(0)]) == 0  # not claimed held: the store dropped it
        assert a.tiers[0].take_evicted() == []  # reported once
