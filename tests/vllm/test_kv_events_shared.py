"""Issue 51: every engine attached to a shared LMDB store reports the blocks it can load from
it, including blocks another engine stored (found at attach, and afterwards), with vLLM's
hashes as it computes them itself, and reports them removed once another process's writes
evicted them. Two engines here are two caches on one LMDB environment in one process (the
store cannot tell: each has its own index, as test_evicted_elsewhere.py does); two engine
processes: tests/vllm/test_router_events.py."""

from __future__ import annotations

import itertools
import random
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core import kv_cache_utils

from tests.vllm.event_roles import BS, close, request, roles, serve, vllm_hashes
from tiercache.connectors.vllm_kv.kv_events import SHARED, BlockDescriptor, EventTranslator
from tiercache.connectors.vllm_kv.shared_blocks import SharedBlocks, decode, encode
from tiercache.tiers.base import present_per_key
from tiercache.tiers.catalog import Catalog, LMDBCatalog

CAP = 8  # blocks the LMDB store holds (every engine's writes evict beyond it)


def _lmdb(path: Path, cpu: int = 0) -> list[dict]:
    tiers = [{"kind": "cpu", "blocks": cpu}] if cpu else []
    return [*tiers, {"kind": "lmdb", "path": str(path / "db"), "blocks": CAP}]


def _engine(path: Path, cpu: int = 0) -> tuple[Any, Any, Any]:
    """One engine's roles; polls of the store run at every `take_events` (no interval)."""
    shared, s, w = roles(_lmdb(path, cpu))
    s._shared_blocks._interval = 0.0  # test probe: every call polls
    return shared, s, w


def _shared_view(events: list[Any], view: set[Any]) -> set[Any]:
    """Apply `events` to a router's view of one engine's SHARED storage blocks."""
    for e in events:
        if getattr(e, "locality", None) != SHARED:
            continue
        if isinstance(e, BlockStored):
            view |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            view -= set(e.block_hashes)
    return view


def _converge(s: Any, view: set[Any], want: set[Any], timeout_s: float = 30.0) -> bool:
    """Poll `s` (an engine step each) until its view equals `want`, or `timeout_s` passed."""
    end = time.monotonic() + timeout_s
    while True:
        _shared_view(list(s.take_events()), view)
        if view == want or time.monotonic() > end:
            return view == want
        time.sleep(0.01)  # one engine step apart


def test_an_engine_reports_blocks_another_stored_before_and_after_it_attached(tmp_path) -> None:
    a = _engine(tmp_path)
    b = c = None
    try:
        first = list(range(1, 1 + 3 * BS + 1))
        events_a = serve(a[1], a[2], a[0], request("a1", first))
        seen_a = _shared_view(events_a, set())
        assert seen_a == set(vllm_hashes(request("x", first))[:3])
        # B attaches after A stored: its first events are the store's snapshot.
        b = _engine(tmp_path, cpu=4)
        seen_b = _shared_view(list(b[1].take_events()), set())
        assert seen_b == seen_a
        # A stores more; B reports them at its next step.
        second = list(range(50, 50 + 2 * BS + 1))
        seen_a = _shared_view(serve(a[1], a[2], a[0], request("a2", second)), seen_a)
        assert _converge(b[1], seen_b, seen_a) and len(seen_b) == 5
        # The description B reports is the whole one: tokens and parents too.
        by_hash = {}
        c = _engine(tmp_path, cpu=2)
        for e in c[1].take_events():
            if isinstance(e, BlockStored):
                by_hash[e.block_hashes[0]] = e
        ext = vllm_hashes(request("y", first))
        assert by_hash[ext[1]].parent_block_hash == ext[0]
        assert by_hash[ext[1]].token_ids == first[BS : 2 * BS]
    finally:
        for e in (a, b, c):
            if e is not None:
                close(*e)


def test_evictions_by_another_engine_are_reported_removed(tmp_path) -> None:
    a, b = _engine(tmp_path), _engine(tmp_path, cpu=4)
    try:
        first = list(range(1, 1 + 4 * BS + 1))
        view_a = _shared_view(serve(a[1], a[2], a[0], request("a1", first)), set())
        view_b = _shared_view(list(b[1].take_events()), set())
        assert view_b == view_a and len(view_b) == 4
        # A fills the store: the store evicts the oldest blocks, A's writes did it; B's
        # index never hears of it from the store, its sweep does.
        more = list(range(300, 300 + 6 * BS + 1))
        before = set(view_a)
        view_a = _shared_view(serve(a[1], a[2], a[0], request("a2", more)), view_a)
        assert len(view_a) == CAP  # A reports the store's own eviction (take_evicted)
        # B converges within a few polls (what A's writes deleted, A deletes in its next
        # write transaction or its background flush: till then B can still load it).
        assert _converge(b[1], view_b, view_a)
        gone = before - view_a
        assert len(gone) == 2 and not gone & view_b
    finally:
        close(*a)
        close(*b)


def test_another_hash_identity_recomputes_the_hashes(tmp_path, monkeypatch) -> None:
    """B's NONE_HASH differs (xxhash without PYTHONHASHSEED, or another PYTHONHASHSEED):
    the hashes A wrote mean nothing to B's router; B reports its own, from the tokens."""
    a = _engine(tmp_path)
    b = None
    try:
        tokens = list(range(9, 9 + 3 * BS + 1))
        theirs = _shared_view(serve(a[1], a[2], a[0], request("a1", tokens)), set())
        monkeypatch.setattr(kv_cache_utils, "NONE_HASH", kv_cache_utils.BlockHash(b"\x07" * 32))
        ours = set(vllm_hashes(request("x", tokens))[:3])  # B's engine hashes with its NONE_HASH
        assert ours.isdisjoint(theirs)
        b = _engine(tmp_path, cpu=4)
        assert _shared_view(list(b[1].take_events()), set()) == ours
    finally:
        for e in (a, b):
            if e is not None:
                close(*e)


def test_catalog_is_bounded_and_records_round_trip(tmp_path: Path) -> None:
    cat = LMDBCatalog(str(tmp_path / "db"), capacity=4, namespace="n")
    other = LMDBCatalog(str(tmp_path / "db"), capacity=4, namespace="n")  # same process
    try:
        d = BlockDescriptor((b"h" * 32,), None, (1, 2, 3, 4), 4, 3, "l", (("l", "s"),))
        cat.put([(bytes([i]) * 16, encode(d, b"id")) for i in range(6)])
        recs, cursor = other.since(0)
        assert [k[0] for k, _ in recs] == [2, 3, 4, 5]  # the oldest two dropped
        rec = decode(recs[0][1])
        assert rec is not None and rec["t"] == [1, 2, 3, 4] and rec["ln"] == "l"
        assert other.since(cursor) == ([], cursor)
        cat.put([(bytes([2]) * 16, b"again")])  # written again: moves to the end
        assert [k[0] for k, _ in other.since(cursor)[0]] == [2]
        assert decode(b"\x93\x01\x02") is None and decode(b"not msgpack") is None
    finally:
        cat.close()
        other.close()


def _redis_engine(url: str, cpu: int = 0, **opts: Any) -> tuple[Any, Any, Any]:
    tiers = [{"kind": "cpu", "blocks": cpu}] if cpu else []
    tiers.append({"kind": "redis", "url": url, "blocks": 64, "prefix": "ev:", **opts})
    shared, s, w = roles(tiers)
    s._shared_blocks._interval = 0.0  # test probe: every call polls
    return shared, s, w


def test_redis_evictions_under_maxmemory_are_reported_by_every_engine(tmp_path) -> None:
    """Redis (allkeys-lru, a small maxmemory) evicts blocks when another client fills it:
    both engines' views fall to what the server still holds."""
    from tests.test_tier_redis import RedisServer, require_redis

    require_redis()
    srv = RedisServer(tmp_path / "redis", "--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    a = b = None
    try:
        a = _redis_engine(srv.url)
        b = _redis_engine(srv.url, cpu=4)
        tokens = list(range(1, 1 + 6 * BS + 1))
        view_a = _shared_view(serve(a[1], a[2], a[0], request("a1", tokens)), set())
        assert view_a == set(vllm_hashes(request("x", tokens))[:6])
        view_b: set[Any] = set()
        assert _converge(b[1], view_b, view_a)
        # Another client fills the server well past maxmemory: LRU evicts our blocks.
        r = srv.client()
        for i in range(400):
            r.set(f"junk:{i}", b"x" * 32768)
        held = {
            h
            for k, h in zip(a[1]._reqs["a1"].keys, vllm_hashes(request("x", tokens)), strict=False)
            if r.exists(a[0].cache.tiers[0].redis_key(k))
        }
        assert len(held) < 6  # something was evicted
        view_a = _shared_view(list(a[1].take_events()), view_a)
        assert view_a == held  # the engine that stored them reports it too
        assert _converge(b[1], view_b, held)  # and the one that did not
    finally:
        for e in (a, b):
            if e is not None:
                close(*e)
        srv.kill()


def test_a_block_the_cache_forgot_stays_reported_while_the_store_holds_it(tmp_path) -> None:
    """B's cache drops a shared block it only adopted (its index is smaller than the store):
    B can still load it (its next lookup finds it again), so no BlockRemoved; a block the
    store no longer holds is reported removed."""
    a, b = _engine(tmp_path), _engine(tmp_path, cpu=4)  # B reads into its CPU tier
    try:
        tokens = list(range(1, 1 + 2 * BS + 1))
        view = _shared_view(serve(a[1], a[2], a[0], request("a1", tokens)), set())
        view_b: set[Any] = set()
        assert _converge(b[1], view_b, view)
        req = request("b1", tokens)
        assert b[1].get_num_new_matched_tokens(req, 0)[0] == 2 * BS  # B adopts both
        keys = b[1]._reqs["b1"].keys[:2]
        b[0].cache.manager.discard([keys[0]], 1)  # B's LMDB index forgets one: stored still
        a[0].cache.manager.discard([keys[1]], 0)  # A deletes the other from the store
        a[0].cache.flush()
        meta = b[2].build_connector_worker_meta()
        assert meta is not None and meta.kept == [keys[0]]
        b[1].update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))
        removed = [e for e in b[1].take_events() if isinstance(e, BlockRemoved)]
        assert [h for e in removed for h in e.block_hashes] == [vllm_hashes(req)[1]]
    finally:
        close(*a)
        close(*b)


class _Gone:
    """A store that holds nothing."""

    def probe(self, keys: Any) -> int:
        return 0

    def present(self, keys: Any) -> list[bool]:
        return present_per_key(self, keys)

    def close(self) -> None:
        pass


class _Empty(Catalog):
    """A catalog nobody writes to."""

    def put(self, items: Any) -> None:
        pass

    def since(self, cursor: int, limit: int = 4096) -> tuple[list, int]:
        return [], cursor

    def close(self) -> None:
        pass


class _Store:
    """A store holding the keys in `keys`; lists the keys asked about."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.asked: list[bytes] = []

    def probe(self, keys: Any) -> int:
        self.asked.extend(keys)
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n

    def present(self, keys: Any) -> list[bool]:
        return present_per_key(self, keys)

    def close(self) -> None:
        pass


def _sweeper(sweep: int, store: Any) -> tuple[EventTranslator, SharedBlocks]:
    tr = EventTranslator({"lmdb": ("STORAGE", SHARED)})
    return tr, SharedBlocks([("lmdb", _Empty())], {"lmdb": store}, sweep_keys=sweep)


def test_the_sweep_reaches_every_block_within_its_bound() -> None:
    """ceil(held / sweep_keys) polls report every block the store lost (the round robin
    wraps around)."""
    d = BlockDescriptor((b"h" * 32,), None, (1, 2, 3, 4), 4)
    for held, sweep in ((5, 2), (3, 4), (7, 3)):
        tr, sb = _sweeper(sweep, _Gone())
        keys = [bytes([i]) * 16 for i in range(held)]
        for k in keys:
            tr.record(k, d)
        tr.apply(keys, "lmdb", False)
        tr.rotate("lmdb", 1)  # start mid-way, as after earlier polls
        for _ in range(-(-held // sweep)):
            sb.poll(tr, force=True)
        assert tr.held_in("lmdb") == [], (held, sweep)


def test_descriptions_a_failed_catalog_write_held_back_are_written_at_the_next_poll() -> None:
    class Flaky(_Empty):  # its first write times out
        def __init__(self) -> None:
            self.failed, self.got = False, []

        def put(self, items: Any) -> None:
            if not self.failed:
                self.failed = True
                raise OSError("timeout")
            self.got += [k for k, _ in items]

    cat = Flaky()
    sb = SharedBlocks([("lmdb", cat)], {"lmdb": _Store()})
    tr = EventTranslator({"lmdb": ("STORAGE", SHARED)}, on_shared=sb.on_shared)
    tr.record(b"k" * 16, BlockDescriptor((b"h" * 32,), None, (1, 2, 3, 4), 4))
    tr.apply([b"k" * 16], "lmdb", False)
    sb.poll(tr, force=True)
    sb.poll(tr, force=True)
    assert cat.failed and cat.got == [b"k" * 16]


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_holds_while_blocks_come_and_go(seed: int) -> None:
    """Between polls the engine stores blocks, stores some again, evicts some itself, and
    the store loses others behind its back: each lost block is reported removed within
    ceil(held / sweep_keys) polls of the moment it was lost, `held` counted then (a sweep
    that kept a position in a list that shifted skipped blocks when the count changed)."""
    rng = random.Random(seed)
    sweep = rng.choice((1, 3, 7, 16))
    store = _Store()
    tr, sb = _sweeper(sweep, store)
    due: dict[bytes, int] = {}  # lost block -> the poll by which it must be reported
    fresh = iter(i.to_bytes(16, "big") for i in itertools.count())
    for poll in range(1, 400):
        held = tr.held_in("lmdb")
        new = [next(fresh) for _ in range(rng.randrange(0, 2 * sweep + 2))]
        store.keys.update(new)
        tr.apply(new, "lmdb", False)
        again = rng.sample(held, min(len(held), rng.randrange(0, 3)))
        tr.apply([k for k in again if k not in due], "lmdb", False)  # stored again
        mine = rng.sample(held, min(len(held), rng.randrange(0, sweep + 1)))
        store.keys.difference_update(mine)
        tr.apply(mine, "lmdb", True)  # the engine's own eviction: reported at once
        n = len(tr.held_in("lmdb"))
        for k in rng.sample(held, min(len(held), rng.randrange(0, sweep + 1))):
            if k in store.keys and tr.holds(k, "lmdb"):
                store.keys.discard(k)  # lost behind the engine's back
                due[k] = poll - 1 + -(-n // sweep)
        sb.poll(tr, force=True)
        for k, last in list(due.items()):
            if not tr.holds(k, "lmdb"):
                del due[k]
            else:
                assert poll < last, (seed, sweep, poll, last)


def test_a_sweep_step_costs_sweep_keys_among_a_million() -> None:
    """A poll with 1,000,000 blocks held in a tier walks `sweep_keys` of them (counted: keys
    the translator's maps hand out, keys the store is asked about), and the next poll the
    next ones."""
    walked = [0]

    def walking(base: type) -> type:
        class Walked(base):  # counts the keys any walk over the map hands out
            def __iter__(self) -> Iterator[bytes]:
                for k in super().__iter__():
                    walked[0] += 1
                    yield k

            def keys(self) -> Any:
                return list(iter(self))

            def items(self) -> Any:
                return [(k, self[k]) for k in self]

            def values(self) -> Any:
                return [self[k] for k in self]

        return Walked

    store = _Store()
    tr, sb = _sweeper(4096, store)
    tr._held = walking(dict)()  # test probe: the maps over all held keys count their walks
    tr._ring = {"lmdb": walking(OrderedDict)()}
    keys = [i.to_bytes(16, "big") for i in range(1_000_000)]
    store.keys.update(keys)
    tr.apply(keys, "lmdb", False)
    for want in (keys[:4096], keys[4096:8192]):  # round robin: the next keys each poll
        walked[0] = 0
        store.asked.clear()
        sb.poll(tr, force=True)
        assert (walked[0], store.asked) == (4096, want)
