"""Replicas sharing one Redis store, in the order that used to go wrong: a second process
opens AFTER the first stored (so it finds the first's blocks at open), then churns past its
capacity. Capacity of the store belongs to the server (maxmemory + an LRU policy): a
replica deletes only blocks it stored itself, never what it found or adopted, and a block
the server evicted is a plain miss. The first replica keeps serving its blocks exactly, or
sees plain misses, and counts no errors."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.campaign_children import churn
from tests.campaign_support import blocks, key, served, start_child
from tests.test_tier_redis import RedisServer, require_redis, unique_prefix
from tiercache import TierCache


@pytest.fixture(scope="module", autouse=True)  # before the module's server fixtures
def _redis_required() -> None:
    require_redis()  # a skip where redis-server is missing; under CI=true a failure


BB, CAP = 16 * 1024, 32


def _server(*args: str) -> Iterator[RedisServer]:
    d = Path(tempfile.mkdtemp(prefix="tc-redis-shared-"))
    s = RedisServer(d, *args)
    yield s
    s.kill()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def plain() -> Iterator[RedisServer]:
    """No maxmemory: nothing but tiercache ever deletes a key."""
    yield from _server()


@pytest.fixture
def lru() -> Iterator[RedisServer]:
    """2 MiB of maxmemory (about half of it left for values: ~50 blocks of 16 KiB) with
    allkeys-lru: fewer than four replicas' capacity of 32 blocks each, so Redis evicts."""
    yield from _server("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")


def tier(s: RedisServer, prefix: str) -> dict:
    return {"kind": "redis", "blocks": CAP, "url": s.url, "prefix": prefix}


def test_a_replica_that_opens_later_and_churns_deletes_nothing_of_the_first(plain) -> None:
    prefix, mine = unique_prefix("late"), list(range(8))
    a = TierCache.open({"namespace": "fleet", "tiers": [tier(plain, prefix)]}, block_bytes=BB)
    try:
        a.put([key(i) for i in mine], blocks(mine, BB))
        # 1. B opens after A stored: it finds A's 8 blocks at open and indexes them. It then
        #    stores 3x its capacity (within what the server holds): its policy evicts A's
        #    blocks from B's index, which must only forget them, never DEL them.
        got = start_child(churn, tier(plain, prefix), BB, "fleet", list(range(100, 196)))
        assert got.result(120) == {"errors": 0}
        assert served(a, mine) == (8, 0, 0)
        assert a.stats()["redis"]["errors"] == 0
        # B deleted its own evicted blocks: the store holds A's 8 and B's newest 32.
        c = plain.client()
        assert sum(1 for _ in c.scan_iter(match=prefix.encode() + b"fleet" + b"?" * 16)) == 40
    finally:
        a.close()


def test_blocks_the_server_evicts_are_plain_misses(lru) -> None:
    prefix, mine = unique_prefix("lru"), list(range(8))
    a = TierCache.open({"namespace": "fleet", "tiers": [tier(lru, prefix)]}, block_bytes=BB)
    try:
        a.put([key(i) for i in mine], blocks(mine, BB))
        # B opens after A stored, then several replicas' worth of churn under other
        # namespaces fills maxmemory: Redis's LRU evicts A's blocks (A never reads them).
        for ns in ("fleet", "other-1", "other-2", "other-3"):
            ids = list(range(1000, 1096)) if ns != "fleet" else list(range(100, 196))
            got = start_child(churn, tier(lru, prefix), BB, ns, ids)
            assert got.result(120) == {"errors": 0}
        exact, missed, wrong = served(a, mine)
        assert wrong == 0 and exact + missed == 8 and missed > 0
        st = a.stats()["redis"]
        assert st["errors"] == 0, st  # evicted by the server: plain misses, not errors
        assert a.tiers[0].stats()["missing"] == missed
    finally:
        a.close()
