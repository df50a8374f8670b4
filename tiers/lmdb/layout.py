"""The bottom of the LMDB tier: the store's constants and key layout, and the store-level
write transaction every process runs alike.

- Constants: store format and version, database names, "meta" record keys, the limits of a
  write transaction (`txn_ops_for`), the option values the tier accepts.
- Keys: `store_key`/`split_store_key`, the order seq after each header (`seq_bytes`,
  `head_seq`), `iter_prefix` (the entries under a key prefix).
- `StoreTxn`: the bookkeeping of one write transaction (puts, deletes, order entries, each
  namespace's count, eviction beyond a capacity), shared by the tier and offline deletes.
- `heads_prober`: how many leading keys have a well-formed header (a lookup's probe; asked
  one key at a time in one transaction, a sweep's `present`), for the tier and `LMDBProbe`
  alike.

Imports nothing of the package but the removal log (`removals`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lmdb

from tiercache.tiers.base import KEY_BYTES
from tiercache.tiers.format import HEADER_SIZE
from tiercache.tiers.lmdb import removals
from tiercache.tiers.lmdb.removals import DELETED, EVICTED, NS_BYTES, REMOVED_DB, SEQ_BYTES
from tiercache.tiers.store_dir import DirRules

STORE_FORMAT = "tiercache-lmdb"
STORE_VERSION = 4  # bump when the environment layout (databases, metadata, keys) changes
# Versions a write open upgrades in place (`env._init_store`) and a read-only open reads: 3
# lacks only the removal log (`removals`), which an upgrade adds empty.
UPGRADES_FROM = (3,)
# NS_BYTES (the namespace-id prefix of every store key) and SEQ_BYTES (the store's order
# sequence number, big-endian, after each header) are the removal log's too: defined there.
META_DB, HEADS_DB, BLOCKS_DB, ORDER_DB = b"meta", b"heads", b"blocks", b"order"
DB_NAMES = (META_DB, HEADS_DB, BLOCKS_DB, ORDER_DB, REMOVED_DB)
META_KEY = b"store"
SEQ_KEY = b"seq"  # meta: the next order sequence number of the environment
COUNT_PREFIX = b"count:"  # meta: + namespace prefix -> that namespace's block count
_OUR_FILES = frozenset({"data.mdb", "lock.mdb"})
DIR_RULES = DirRules("LMDB", _OUR_FILES)
# what becomes of a namespace's blocks beyond a tier's capacity at open (see StoreTxn.evict)
EVICTS_LATER = "the store evicts the %d oldest at its next write of this namespace"

SYNC_MODES = ("never", "batch", "always")
MAX_READERS = 512  # reader-table slots: one per open read txn, across all processes
MIN_TXN_OPS = 64
MAX_TXN_OPS = 256


def store_key(namespace: int, key: bytes) -> bytes:
    """The LMDB key of block `key` of the namespace with id `namespace`."""
    return namespace.to_bytes(NS_BYTES, "big") + key


def split_store_key(skey: bytes) -> tuple[int, bytes] | None:
    """(namespace id, block key) of a store key; None when it is not one."""
    if len(skey) != NS_BYTES + KEY_BYTES:
        return None
    return int.from_bytes(skey[:NS_BYTES], "big"), skey[NS_BYTES:]


def txn_ops_for(capacity_blocks: int) -> int:
    """Most block puts + deletes in one write transaction."""
    return min(MAX_TXN_OPS, max(MIN_TXN_OPS, math.ceil(capacity_blocks / 8)))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def head_seq(head: bytes | memoryview | None) -> int | None:
    """The order sequence number stored after a header; None when there is none."""
    if head is None or len(head) != HEADER_SIZE + SEQ_BYTES:
        return None
    return int.from_bytes(head[HEADER_SIZE:], "big")


def u64(raw: bytes | memoryview | None) -> int:
    return 0 if raw is None or len(raw) != 8 else int.from_bytes(raw, "big")


def iter_prefix(cursor: Any, prefix: bytes, values: bool) -> Iterator[Any]:
    """(key, value) - or, without `values`, the key - of every entry of `cursor`'s database
    whose key starts with `prefix`, in key order (keys as bytes)."""
    if not cursor.set_range(prefix):
        return
    for item in cursor.iternext(values=values):
        k = bytes(item[0] if values else item)
        if not k.startswith(prefix):
            return
        yield (k, item[1]) if values else k


class StoreTxn:
    """The bookkeeping of one write transaction, shared by every process: blocks put and
    deleted with their "order" entries (namespace prefix + order seq -> block key, oldest
    first), each namespace's block count and the environment's next order seq in "meta",
    and, where the store has a removal log (`removed`), a record of every block removed."""

    def __init__(
        self,
        txn: lmdb.Transaction,
        meta: Any,
        heads: Any,
        blocks: Any,
        order: Any,
        removed: Any = None,
    ):
        self.txn, self.meta, self.heads, self.blocks, self.order = txn, meta, heads, blocks, order
        self.removed_db = removed
        self.seq = self.seq0 = u64(txn.get(SEQ_KEY, db=meta))
        self.counts: dict[bytes, int] = {}  # namespace prefix -> its count (read when used)
        self.dirty: set[bytes] = set()
        self.evicted: list[bytes] = []  # block keys `evict` deleted, oldest first
        # (namespace prefix, reason) -> [(block key, its order seq)]: the removal log's records
        self.removed: dict[tuple[bytes, bytes], list[tuple[bytes, int]]] = {}

    def count(self, nsb: bytes) -> int:
        c = self.counts.get(nsb)
        if c is None:
            c = self.counts[nsb] = u64(self.txn.get(COUNT_PREFIX + nsb, db=self.meta))
        return c

    def _add(self, nsb: bytes, d: int) -> None:
        self.counts[nsb] = max(0, self.count(nsb) + d)
        self.dirty.add(nsb)

    def _drop(self, sk: bytes, head: bytes, reason: bytes, order_too: bool = True) -> None:
        txn = self.txn
        txn.delete(sk, db=self.heads)
        txn.delete(sk, db=self.blocks)
        seq = head_seq(head)
        if seq is not None and self.removed_db is not None:
            self.removed.setdefault((sk[:NS_BYTES], reason), []).append((sk[NS_BYTES:], seq))
        if order_too and seq is not None:
            ok = sk[:NS_BYTES] + seq_bytes(seq)
            if txn.get(ok, db=self.order) == sk[NS_BYTES:]:  # a copied header points elsewhere
                txn.delete(ok, db=self.order)
        self._add(sk[:NS_BYTES], -1)

    def delete(self, sk: bytes, want: int | None) -> None:
        """Delete the block under `sk`; with `want`, only if its order seq is still that (a
        block stored again since it was found bad stays)."""
        head = self.txn.get(sk, db=self.heads)
        if head is None:
            self.txn.delete(sk, db=self.blocks)  # an orphan payload: never counted
        elif want is None or head_seq(head) == want:
            self._drop(sk, head, DELETED)

    def put(self, sk: bytes, header: bytes, payload: Any) -> None:
        txn, nsb = self.txn, sk[:NS_BYTES]
        old = head_seq(txn.get(sk, db=self.heads))
        if old is None:
            self._add(nsb, 1)  # (a malformed old header was never counted either)
        else:
            txn.delete(nsb + seq_bytes(old), db=self.order)
        sb = seq_bytes(self.seq)
        self.seq += 1
        txn.put(sk, header + sb, db=self.heads)
        txn.put(sk, payload, db=self.blocks)
        txn.put(nsb + sb, sk[NS_BYTES:], db=self.order)

    def evict(self, nsb: bytes, capacity: int) -> None:
        """Delete the namespace's oldest blocks while it holds more than `capacity`; their
        block keys are added to `evicted` (the tier reports them: `LMDBTier.take_evicted`)."""
        if self.count(nsb) <= capacity:
            return
        cur = self.txn.cursor(db=self.order)
        if not cur.set_range(nsb):
            return
        while self.counts[nsb] > capacity:
            ok = cur.key()
            if not ok.startswith(nsb) or len(ok) != NS_BYTES + SEQ_BYTES:
                break  # the count ran ahead of the entries (damage): nothing more to evict
            sk = nsb + cur.value()
            cur.delete()  # the cursor moves to the next entry
            head = self.txn.get(sk, db=self.heads)
            if head is not None and head_seq(head) == int.from_bytes(ok[NS_BYTES:], "big"):
                self._drop(sk, head, EVICTED, order_too=False)
                self.evicted.append(sk[NS_BYTES:])

    def finish(self, keep: int | None = None) -> None:
        """Write what the transaction changed besides blocks: the removal log's records
        (each with an order seq of its own, so the log sorts by commit; with `keep`, each
        namespace's oldest records beyond `keep` entries go), the counts and the next seq."""
        by_ns: dict[bytes, list[tuple[int, bytes, list[tuple[bytes, int]]]]] = {}
        for (nsb, reason), gone in self.removed.items():
            by_ns.setdefault(nsb, []).append((self.seq, reason, gone))
            self.seq += 1
        for nsb, records in by_ns.items():
            removals.append(self.txn, self.meta, self.removed_db, nsb, records, keep)
        if self.seq != self.seq0:
            self.txn.put(SEQ_KEY, self.seq.to_bytes(8, "big"), db=self.meta)
        for nsb in self.dirty:
            self.txn.put(COUNT_PREFIX + nsb, self.counts[nsb].to_bytes(8, "big"), db=self.meta)


# What `heads_prober` builds: (txn, keys) -> how many leading keys are held.
Prober = Callable[[lmdb.Transaction, Sequence[bytes]], int]


def heads_prober(
    heads: Any,
    order: Any,
    nsb: bytes,
    ours: Callable[[object, bytes], bool],
    bad: Callable[[bytes, bytes], None] | None = None,
) -> Prober:
    """A function of (txn, keys): how many leading `keys` have a well-formed header in
    `heads` under the namespace prefix `nsb` (`ours`: `format.header_check` of that namespace
    and block size) and an entry in `order` naming the key at the header's seq (the seq is
    not covered by the checksum). `bad` hears of the entry (store key, head) where the run
    stops on one that is malformed. Built once per store: a single-key lookup's probe runs
    it once per key."""

    def leading(txn: lmdb.Transaction, keys: Sequence[bytes]) -> int:
        if len(keys) == 1:  # a single-key lookup's probe: the loop below, unrolled
            k = keys[0]
            sk = nsb + k
            try:
                head = txn.get(sk, None, heads)
                if head is None:
                    return 0
                if ours(head, k) and txn.get(nsb + head[HEADER_SIZE:], None, order) == k:
                    return 1
            except lmdb.Error:
                return 0
            if bad is not None:
                bad(sk, bytes(head))
            return 0
        get = txn.get
        n = 0
        try:
            for k in keys:
                sk = nsb + k
                head = get(sk, None, heads)  # positional: py-lmdb parses keywords slowly
                if head is None:
                    break
                if not ours(head, k) or get(nsb + head[HEADER_SIZE:], None, order) != k:
                    if bad is not None:
                        bad(sk, bytes(head))
                    break
                n += 1
        except lmdb.Error:
            pass  # what was counted stands; a read verifies each block anyway
        return n

    return leading
