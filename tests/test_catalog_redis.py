"""What shared-block events (issue 51) keep in and ask of Redis under a `maxmemory` policy
that may evict any key (allkeys-*): `RedisCatalog` with its counter, its sorted set, or both
evicted still hands every record written afterwards to readers; `RedisTier.present` (the
sweep's question) leaves the keys' LRU/LFU standing as it was."""

from __future__ import annotations

from pathlib import Path

from tests.test_tier_redis import RedisServer, require_redis
from tiercache.tiers.catalog import RedisCatalog
from tiercache.tiers.redis import RedisTier


def test_records_written_after_the_catalogs_own_keys_were_evicted_reach_readers(
    tmp_path: Path,
) -> None:
    require_redis()
    srv = RedisServer(tmp_path / "redis")
    r = srv.client()
    writer, reader = RedisCatalog(srv.client(), b"p:", 8), RedisCatalog(srv.client(), b"p:", 8)
    try:
        writer.put([(b"a", b"1"), (b"b", b"2"), (b"c", b"3")])
        recs, cursor = reader.since(0)
        assert [k for k, _ in recs] == [b"a", b"b", b"c"]
        r.delete(b"p:#catalog:seq")  # the counter evicted: the sorted set carries on
        writer.put([(b"d", b"4")])
        recs, cursor = reader.since(cursor)
        assert recs == [(b"d", b"4")]
        r.delete(b"p:#catalog:seq", b"p:#catalog:order")  # both: the reader starts over
        writer.put([(b"e", b"5")])
        assert reader.since(cursor)[0] == [(b"e", b"5")]
    finally:
        for c in (writer, reader):
            c.close()
        r.close()
        srv.kill()


def test_the_sweeps_presence_check_leaves_the_keys_use_alone(tmp_path: Path) -> None:
    """LFU's counter (OBJECT FREQ) starts at 5 and the first read makes it 6: a sweep that
    read the blocks would make Redis's policy keep them, over the blocks really used."""
    require_redis()
    srv = RedisServer(tmp_path / "redis", "--maxmemory-policy", "allkeys-lfu")
    r = srv.client()
    tier = RedisTier(url=srv.url, block_bytes=64, capacity_blocks=4, prefix="s:")
    try:
        keys = [bytes([i]) * 16 for i in range(3)]
        for k in keys[:2]:
            r.set(tier.redis_key(k), b"v")
        assert tier.present(keys) == [True, True, False]
        assert [r.object("freq", tier.redis_key(k)) for k in keys[:2]] == [5, 5]
        r.getrange(tier.redis_key(keys[0]), 0, 0)  # a read counts: what a probe would do
        assert r.object("freq", tier.redis_key(keys[0])) == 6
    finally:
        tier.close()
        r.close()
        srv.kill()
