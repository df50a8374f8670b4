"""The LMDB store's removal log (store format 4): every block a write transaction removes,
by the store's capacity or by a delete, is recorded in that transaction, so any process can
read every process's removals, a SIGKILLed one's included; the log keeps what it is asked
to; a store of format 3 is upgraded in place, its blocks kept."""

from __future__ import annotations

import json
import random

import lmdb
import pytest
import torch

from tests.campaign_children import lmdb_put_then_die
from tests.campaign_support import ChildDied, blocks, key, key_id, open_tier, run_child
from tiercache.errors import ConfigError
from tiercache.tiers.lmdb import delete_entries, open_store
from tiercache.tiers.lmdb import removals as removal_log
from tiercache.tiers.lmdb.layout import META_KEY, REMOVED_DB, head_seq

BB = 4096


class _Writer:
    """A tier on the store at `path` that indexes nothing at open (as a process that opens
    a store other processes wrote: its slots are its own), and the slot of each id it put."""

    def __init__(self, path, cap: int, **kw) -> None:
        self.t = open_tier("lmdb", path, BB, cap, lazy=True, **kw)
        self.slots: dict[int, int] = {}  # id -> slot, oldest first

    def put(self, ids: list[int]) -> None:
        """Store `ids`; where its slots are full, free its oldest first (a delete). The
        store evicts only beyond the namespace's capacity: where several tiers write it."""
        t, ks = self.t, [key(i) for i in ids]
        for i in ids:
            if i in self.slots:
                t.free([self.slots.pop(i)])
        while t.free_blocks < len(ids):
            self.free(next(iter(self.slots)))
        slots = t.allocate(ks)
        t.write(slots, blocks(ids, BB), ks)
        self.slots.update(zip(ids, slots, strict=True))

    def free(self, i: int) -> None:
        self.t.free([self.slots.pop(i)])

    def close(self) -> None:
        self.t.close()


def _seqs(t, ids: list[int]) -> dict[int, int | None]:
    """The order seq each of `ids` is stored under now (None: not held)."""
    sh = t._shared
    with sh.env.begin() as txn:
        return {i: head_seq(txn.get(t._nsb + key(i), db=sh.heads)) for i in ids}


def _held(t) -> set[tuple[int, int]]:
    """(id, order seq) of every block of `t`'s namespace the store holds."""
    sh = t._shared
    with sh.env.begin() as txn:
        cur = txn.cursor(db=sh.heads)
        return {(key_id(bytes(k[8:])), head_seq(v)) for k, v in cur if bytes(k[:8]) == t._nsb}


def _removed(t, after: int = -1) -> list[tuple[int, int, str]]:
    return [(key_id(r.key), r.seq, r.reason) for r in t.removals(after)]


def test_evictions_and_deletes_are_logged_with_the_seq_they_removed(tmp_path) -> None:
    a, b = _Writer(tmp_path / "s", 4), _Writer(tmp_path / "s", 4)
    try:
        a.put([0, 1, 2, 3])
        first = _seqs(a.t, [0, 1, 2, 3])
        assert a.t.removals() == []
        b.put([4, 5])  # over the store's capacity: 0 and 1 go
        got = a.t.removals()
        assert _removed(a.t) == [(0, first[0], "evicted"), (1, first[1], "evicted")]
        assert all(r.at > r.seq for r in got) and len({r.at for r in got}) == 1
        # A freed block goes in the next write transaction: logged as deleted.
        a.free(2)
        b.put([6])  # 3, 4, 5, 6: nothing over the capacity
        assert _removed(a.t, after=got[-1].at) == [(2, first[2], "deleted")]
        later = a.t.removals(after=got[-1].at)
        assert all(r.at > got[-1].at for r in later)
        assert a.t.removals(after=later[-1].at) == []
    finally:
        a.close()
        b.close()


def test_another_process_killed_after_its_commit_leaves_its_evictions_logged(tmp_path) -> None:
    """The process that evicts reports its evictions only after its commit (`take_evicted`);
    killed right after the commit, it reports nothing: the log, committed with them, has
    them, for every other process to read."""
    path = tmp_path / "s"
    w = _Writer(path, 4, namespace="fleet")
    try:
        w.put([0, 1, 2, 3])
        ours = _seqs(w.t, [0, 1, 2, 3])
        with pytest.raises(ChildDied):
            run_child(lmdb_put_then_die, str(path), BB, 4, [100, 101, 102])
        assert _removed(w.t) == [(i, ours[i], "evicted") for i in (0, 1, 2)]
        assert _seqs(w.t, [0, 1, 2, 3]) == {0: None, 1: None, 2: None, 3: ours[3]}
    finally:
        w.close()


def test_every_block_stored_is_held_or_in_the_log(tmp_path) -> None:
    """The property a ledger relies on: over random puts and frees by two writers (the log
    keeping more than all of it), each version of each block ever stored is held now, under
    its seq or a later one's (a put of a key held replaces it), or logged removed under that
    seq or a later one's: never neither. No version is both held and logged."""
    rnd = random.Random(7)
    ws = [_Writer(tmp_path / "s", 8, removals_kept=100_000) for _ in range(2)]
    stored: set[tuple[int, int]] = set()
    try:
        for n in range(200):
            w = ws[n % 2]
            if rnd.random() < 0.2 and w.slots:
                w.free(rnd.choice(list(w.slots)))
            ids = rnd.sample(range(30 * (n % 2), 30 * (n % 2) + 30), rnd.randint(1, 4))
            w.put(ids)
            stored |= {(i, s) for i, s in _seqs(w.t, ids).items() if s is not None}
        for w in ws:
            w.t.flush()  # the frees not yet written go now
        held = _held(ws[0].t)
        logged = [(i, s) for i, s, _ in _removed(ws[0].t)]
        assert len(logged) == len(set(logged))  # each version removed once
        last = {}
        for i, s in held | set(logged):
            last[i] = max(s, last.get(i, -1))
        assert not {(i, s) for i, s in stored if last.get(i, -1) < s}
        assert not held & set(logged)
        assert {r for _, _, r in _removed(ws[0].t)} == {"evicted", "deleted"}
    finally:
        for w in ws:
            w.close()


def test_the_log_keeps_what_it_is_asked_to_and_counts_it(tmp_path) -> None:
    a, b = (_Writer(tmp_path / "s", 4, removals_kept=10) for _ in range(2))
    try:
        for n in range(20):
            (a, b)[n % 2].put([n])
        got = _removed(a.t)
        # Whole records go: at least the 10 newest entries stay, fewer than 10 + a record.
        assert 10 <= len(got) < 12
        assert [i for i, _, _ in got] == list(range(16 - len(got), 16))
        sh = a.t._shared
        with sh.env.begin() as txn:
            assert removal_log.held(txn, sh.meta, a.t._nsb) == len(got)
    finally:
        a.close()
        b.close()
    with pytest.raises(ConfigError, match=r"removals_kept: expected an int >= 1, got 0"):
        open_tier("lmdb", tmp_path / "s", BB, 4, removals_kept=0)


def test_an_offline_delete_is_logged(tmp_path) -> None:
    path = tmp_path / "s"
    w = _Writer(path, 8)
    w.put([1, 2, 3])
    seqs = _seqs(w.t, [1, 2, 3])
    ns = w.t._nsb
    w.close()
    with open_store(path, write=True) as h:
        assert delete_entries(h, [ns + key(2)]) == 1
    w = _Writer(path, 8)
    try:
        assert _removed(w.t) == [(2, seqs[2], "deleted")]
    finally:
        w.close()


def _as_format_3(path) -> None:
    """Make the store at `path` what format 3 wrote: no removal log, version 3."""
    env = lmdb.open(str(path), max_dbs=5, map_size=0)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(REMOVED_DB, txn=txn), delete=True)
        meta = env.open_db(b"meta", txn=txn)
        m = json.loads(txn.get(META_KEY, db=meta))
        txn.put(META_KEY, json.dumps({**m, "version": 3}).encode(), db=meta)
    env.close()


def test_a_format_3_store_is_read_then_upgraded_in_place_with_its_blocks(tmp_path) -> None:
    path = tmp_path / "s"
    w = _Writer(path, 4)
    w.put([1, 2])
    w.close()
    _as_format_3(path)
    with open_store(path) as h:  # read-only: read as it is
        assert h.meta["version"] == 3 and h.removed is None
        with h.env.begin() as txn:
            assert txn.stat(h.heads)["entries"] == 2
    t = open_tier("lmdb", path, BB, 4)  # a write open upgrades it
    other = _Writer(path, 4)
    try:
        out = torch.empty((2, BB), dtype=torch.uint8)
        slots = {key_id(k): s for k, s in t.recover()}
        assert t.read([slots[1], slots[2]], out, [key(1), key(2)]) == []
        assert torch.equal(out, blocks([1, 2], BB))
        other.put([3, 4, 5])
        assert [i for i, _, _ in _removed(t)] == [1]
    finally:
        t.close()
        other.close()
    with open_store(path) as h:
        assert h.meta["version"] == 4 and h.removed is not None


def test_each_namespace_reads_its_own_removals(tmp_path) -> None:
    path = tmp_path / "s"
    a, a2 = _Writer(path, 2, namespace="a"), _Writer(path, 2, namespace="a")
    b, b2 = _Writer(path, 2, namespace="b"), _Writer(path, 2, namespace="b")
    try:
        a.put([1, 2])
        b.put([1, 2])
        a2.put([3])
        b2.put([3, 4])
        assert [(i, r) for i, _, r in _removed(a.t)] == [(1, "evicted")]
        assert [(i, r) for i, _, r in _removed(b.t)] == [(1, "evicted"), (2, "evicted")]
    finally:
        for w in (a, a2, b, b2):
            w.close()


def test_take_evicted_tails_every_process_removals_that_are_still_gone(tmp_path) -> None:
    """`take_evicted` reports what this tier's writes evicted and what any other process's
    removed (the log's tail), each once, and only while the store lacks it: a key stored
    again since is held, not reported. Records from before the tier opened are not read."""
    path = tmp_path / "s"
    old = _Writer(path, 4)
    a = b = c = None
    try:
        old.put([90, 91, 92, 93])
        old.put([94])  # evicts 90 before a and b open: not theirs to report
        a, b, c = _Writer(path, 4), _Writer(path, 4), _Writer(path, 4)
        b.put([0, 1, 2, 3])  # evicts 91..94
        assert sorted(key_id(k) for k in a.t.take_evicted()) == [91, 92, 93, 94]
        assert sorted(key_id(k) for k in b.t.take_evicted()) == [91, 92, 93, 94]  # its own
        assert a.t.take_evicted() == [] and b.t.take_evicted() == []  # each once
        b.put([4, 5])  # evicts 0, 1
        c.put([0])  # 0 again (a new version); evicts 2
        assert sorted(key_id(k) for k in a.t.take_evicted()) == [1, 2]
        assert sorted(key_id(k) for k in b.t.take_evicted()) == [1, 2]  # 0 is held again
        c.free(0)
        c.t.flush()  # the delete is written (logged "deleted")
        assert [key_id(k) for k in a.t.take_evicted()] == [0]
    finally:
        for w in (old, a, b, c):
            if w is not None:
                w.close()


def test_a_tail_starts_after_its_own_namespace_newest_record(tmp_path) -> None:
    """`Tail` starts at its namespace's newest record, whichever namespaces sort around it,
    and takes each later record once."""
    env = lmdb.open(str(tmp_path / "e"), max_dbs=2)
    db = env.open_db(REMOVED_DB)
    ns = [bytes([0] * 7 + [i]) for i in (1, 2, 3)] + [b"\xff" * 8]
    with env.begin(write=True) as txn:
        for i, nsb in enumerate(ns[:2] + ns[3:]):
            for at in (10 + i, 20 + i):
                txn.put(
                    nsb + at.to_bytes(8, "big"), removal_log.encode(b"E", [(key(at), 1)]), db=db
                )
    with env.begin() as txn:
        tails = [removal_log.Tail(txn, db, nsb) for nsb in ns]
        assert [t.at for t in tails] == [20, 21, -1, 22]
    with env.begin(write=True) as txn:
        txn.put(ns[2] + (30).to_bytes(8, "big"), removal_log.encode(b"D", [(key(5), 3)]), db=db)
        txn.put(ns[0] + (31).to_bytes(8, "big"), removal_log.encode(b"E", [(key(6), 4)]), db=db)
    with env.begin() as txn:
        got = [[(r.at, key_id(r.key), r.reason) for r in t.take(txn)] for t in tails]
        assert got == [[(31, 6, "evicted")], [], [(30, 5, "deleted")], []]
        assert [t.take(txn) for t in tails] == [[], [], [], []]
    env.close()
