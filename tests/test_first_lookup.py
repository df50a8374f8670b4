"""First lookups of one key after a lazy LMDB open, in a fresh process (a restart).

The manager answers a one-key chain that no tier holds, when its only tier is shared and has
room, without its general discover loop (`OffloadingManager.lookup_ready`'s fast path). These
tests pin that path to the general one: the same store, opened in two fresh processes, one
with the fast path turned off, answers the same operations with the same results, stats,
events and store afterwards. The store holds blocks of two namespaces (another tenant's equal
key is a miss here), two malformed entries a lazy open does not scan (a damaged header, a
header whose seq names no order entry: both misses, dropped at the close), and keys stored
nowhere. A small capacity makes some first lookups evict (the path the fast one defers to).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lmdb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.campaign_children import first_lookups
from tests.campaign_support import blocks, key, payload, run_child
from tiercache import TierCache
from tiercache.tiers.format import header_check, namespace_id
from tiercache.tiers.lmdb import layout as lmdb_tier
from tiercache.tiers.lmdb.layout import heads_prober

BB = 256
IN_A = list(range(8))  # stored in namespace "a", the one the lookups open
IN_B = [0, 1, 10, 11]  # stored in namespace "b": 10 and 11 only there (another tenant's)
BAD_HEADER, BAD_SEQ = 6, 7  # of IN_A, made malformed after the fill
IDS = range(14)  # 12 and 13: stored nowhere


def build_store(path: Path) -> None:
    """The store the lookups open: the same bytes every time it is built."""
    for ns, ids in (("a", IN_A), ("b", IN_B)):
        config = {"namespace": ns, "tiers": [{"kind": "lmdb", "blocks": 16, "path": str(path)}]}
        with TierCache.open(config, block_bytes=BB) as cache:
            assert cache.put([key(i) for i in ids], blocks(ids, BB)) == len(ids)
    env = lmdb.open(str(path), max_dbs=4, mode=0o600)
    try:  # damage no lazy open sees: the databases keep their sizes
        heads = env.open_db(lmdb_tier.HEADS_DB, create=False)
        nsb = namespace_id("a").to_bytes(lmdb_tier.NS_BYTES, "big")
        with env.begin(write=True, db=heads) as txn:
            head = bytearray(txn.get(nsb + key(BAD_HEADER)))
            head[8] ^= 1  # the key the header names
            txn.put(nsb + key(BAD_HEADER), bytes(head))
            head = bytearray(txn.get(nsb + key(BAD_SEQ)))
            head[-8:] = (2**60).to_bytes(8, "big")  # a seq with no order entry
            txn.put(nsb + key(BAD_SEQ), bytes(head))
    finally:
        env.close()


def both_ways(ops: list[Any], capacity: int = 16) -> tuple[dict[str, Any], dict[str, Any]]:
    """`ops` on two builds of the store, each in a fresh process: (fast path, general)."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for general in (False, True):
            path = Path(tmp) / f"store-{general}"
            build_store(path)
            runs.append(run_child(first_lookups, str(path), BB, capacity, ops, general))
    return runs[0], runs[1]


def same_but_path(fast: dict[str, Any], general: dict[str, Any]) -> None:
    """Everything but how often the general loop ran is the same."""
    for name in ("answers", "stats", "tier", "events", "held_after"):
        assert fast[name] == general[name], name
    assert fast["discover_calls"] <= general["discover_calls"]


def test_a_one_key_probe_answers_as_the_chain_loop(tmp_path: Path) -> None:
    # `heads_prober` unrolls its loop for one key (a single-key lookup's probe): every kind
    # of entry (held, damaged header, seq naming no order entry, another tenant's, stored
    # nowhere) answers as the loop does for a chain that starts with it, and the malformed
    # ones are reported alike.
    build_store(tmp_path / "s")
    env = lmdb.open(str(tmp_path / "s"), max_dbs=4, readonly=True, lock=False)
    try:
        heads = env.open_db(lmdb_tier.HEADS_DB, create=False)
        order = env.open_db(lmdb_tier.ORDER_DB, create=False)
        nsb = namespace_id("a").to_bytes(lmdb_tier.NS_BYTES, "big")
        ours = header_check(namespace_id("a"), BB)
        bad_one: list[tuple[bytes, bytes]] = []
        bad_loop: list[tuple[bytes, bytes]] = []
        one = heads_prober(heads, order, nsb, ours, lambda sk, h: bad_one.append((sk, h)))
        loop = heads_prober(heads, order, nsb, ours, lambda sk, h: bad_loop.append((sk, h)))
        with env.begin() as txn:
            answers = [one(txn, [key(i)]) for i in IDS]
            # The chain goes on with a key stored nowhere: the loop answers for the first.
            assert answers == [loop(txn, [key(i), key(12)]) for i in IDS]
    finally:
        env.close()
    assert answers == [int(i in IN_A and i not in (BAD_HEADER, BAD_SEQ)) for i in IDS]
    assert [sk[-16:] for sk, _ in bad_one] == [key(BAD_HEADER), key(BAD_SEQ)]
    assert bad_one == bad_loop


def test_one_key_first_lookups_answer_as_the_general_path() -> None:
    digest = int(payload(4, BB).astype("int64").sum())
    ops = [
        ["one", 0, True],  # held: discovered, a hit
        ["one", 0, True],  # indexed now: a hit, no probe
        ["one", BAD_HEADER, True],  # malformed: a miss, dropped at the close
        ["one", BAD_SEQ, True],  # malformed: a miss, dropped at the close
        ["one", 10, True],  # another tenant's key: a miss here
        ["one", 12, True],  # stored nowhere
        ["chain", [1, 2, 3]],  # the general loop: one probe for the run
        ["get", 4],  # a read's lookup takes the fast path too; the bytes are exact
        ["one", 5, False],  # not counted
    ]
    fast, general = both_ways(ops)
    same_but_path(fast, general)
    assert fast["answers"] == [1, 1, 0, 0, 0, 0, 3, [1, digest], 1]
    st = fast["stats"]["lmdb"]
    assert (st["hits"], st["misses"], st["discovered"]) == (6, 4, 6)
    assert fast["tier"]["malformed_dropped"] == 2
    assert fast["held_after"] == [0, 1, 2, 3, 4, 5]  # 6 and 7 dropped; b's keys are b's
    stored = [e[0] for e in fast["events"] if not e[2]]
    assert stored == [[key(i).hex() for i in run] for run in ([0], [3, 2, 1], [4], [5])]
    # The fast path ran: the general loop only for the chain (one call) against one per
    # lookup of a key not indexed yet.
    assert (fast["discover_calls"], general["discover_calls"]) == (1, 8)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("one"), st.sampled_from(IDS), st.booleans()).map(list),
        st.tuples(
            st.just("chain"), st.lists(st.sampled_from(IDS), min_size=2, max_size=4, unique=True)
        ).map(list),
        st.tuples(st.just("get"), st.sampled_from(IDS)).map(list),
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, capacity=st.sampled_from([3, 16]))
def test_any_lookups_after_a_restart_match_the_general_path(ops: list[Any], capacity: int) -> None:
    # Capacity 3 (the store holds 8 of "a"): first lookups past the third need an eviction,
    # which the fast path leaves to the general one.
    fast, general = both_ways(ops, capacity)
    same_but_path(fast, general)
