"""The store's removal log: which blocks each write transaction removed, written durably in
that same transaction (store format 4).

Why: a shared store's capacity belongs to the store, so one process's put evicts blocks
other processes stored, and the process that evicted them reports them (`take_evicted`) only
after its commit; a process SIGKILLed between its commit and that report leaves no word of
what went. The log is committed with the removal itself, so every removal any process made
can be read back after any crash: by a reader that tails a shared store's removals (a
router, `tiercache`'s own campaigns' ledgers), whichever process made them.

Layout: database "removed", one record per namespace per write transaction that removed
blocks of it, for each reason: key = namespace prefix + an order seq taken from the
environment's sequence (so records sort by commit, and after every block they name), value
= the reason byte + per block its 16-byte key and the 8-byte order seq it was stored under.
"meta" keeps per namespace the number of block entries its records hold (`HELD_PREFIX`);
a writer that trims (`StoreTxn.finish(keep=...)`) drops the oldest records beyond `keep`.

Imports nothing of the package but the key sizes."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import lmdb

from tiercache.tiers.base import KEY_BYTES

REMOVED_DB = b"removed"
HELD_PREFIX = b"removed:"  # meta: + namespace prefix -> block entries its records hold
EVICTED, DELETED = b"E", b"D"  # by the store's capacity; by a delete (freed, damaged, CLI)
REASONS = {EVICTED: "evicted", DELETED: "deleted"}
NS_BYTES = 8  # the namespace-id prefix of every store key (layout's, and this log's keys')
SEQ_BYTES = 8  # the store's order sequence number, big-endian (the order's and this log's)
_ENTRY = KEY_BYTES + SEQ_BYTES
KEEP_MIN = 1024  # the fewest block entries a tier keeps per namespace


def keep_for(capacity_blocks: int) -> int:
    """How many block entries a tier of this capacity keeps in its namespace's log: one
    store's worth of turnover (at least `KEEP_MIN`), ~24 bytes a block, within the map's
    per-block allowance (`env.ENTRY_BYTES`)."""
    return max(KEEP_MIN, capacity_blocks)


@dataclass(frozen=True)
class Removal:
    """One block a write transaction removed from the store."""

    at: int  # the record's order seq: larger for a later commit, above `seq`
    key: bytes  # the 16-byte block key (without the namespace prefix)
    seq: int  # the order seq the removed block had been stored under
    reason: str  # "evicted" (the store's capacity) or "deleted" (freed, damaged, CLI)


def encode(reason: bytes, removed: Iterable[tuple[bytes, int]]) -> bytes:
    """A record's value: `reason` + each (block key, order seq)."""
    return reason + b"".join(k + s.to_bytes(SEQ_BYTES, "big") for k, s in removed)


def decode(nsb_seq: bytes, value: bytes | memoryview) -> list[Removal]:
    """The removals a record holds; ValueError when it is malformed."""
    raw = bytes(value)
    reason = REASONS.get(raw[:1])
    if reason is None or len(nsb_seq) != NS_BYTES + SEQ_BYTES or (len(raw) - 1) % _ENTRY:
        raise ValueError(f"malformed removal record {nsb_seq.hex()}")
    at = int.from_bytes(nsb_seq[NS_BYTES:], "big")
    out = []
    for o in range(1, len(raw), _ENTRY):
        key, seq = raw[o : o + KEY_BYTES], int.from_bytes(raw[o + KEY_BYTES : o + _ENTRY], "big")
        out.append(Removal(at, key, seq, reason))
    return out


def held(txn: lmdb.Transaction, meta: Any, nsb: bytes) -> int:
    """Block entries the namespace's records hold."""
    raw = txn.get(HELD_PREFIX + nsb, db=meta)
    return 0 if raw is None or len(raw) != 8 else int.from_bytes(raw, "big")


def append(
    txn: lmdb.Transaction,
    meta: Any,
    removed_db: Any,
    nsb: bytes,
    records: list[tuple[int, bytes, list[tuple[bytes, int]]]],
    keep: int | None,
) -> None:
    """Put `records` ((order seq, reason, [(block key, seq)])) of namespace `nsb` in `txn`,
    then, with `keep`, drop its oldest records while it holds more than `keep` entries
    (never the ones just put)."""
    n = held(txn, meta, nsb)
    for at, reason, removed in records:
        txn.put(nsb + at.to_bytes(SEQ_BYTES, "big"), encode(reason, removed), db=removed_db)
        n += len(removed)
    if keep is not None and n > keep:
        first_new = nsb + records[0][0].to_bytes(SEQ_BYTES, "big")
        cur = txn.cursor(db=removed_db)
        if cur.set_range(nsb):
            while n > keep:
                k = cur.key()
                if not k.startswith(nsb) or k >= first_new:
                    break
                n -= max(0, (len(cur.value()) - 1) // _ENTRY)
                cur.delete()  # the cursor moves to the next record
    txn.put(HELD_PREFIX + nsb, max(0, n).to_bytes(8, "big"), db=meta)


def read(txn: lmdb.Transaction, removed_db: Any, nsb: bytes, after: int = -1) -> Iterator[Removal]:
    """The namespace's removals in records committed after order seq `after`, oldest first
    (a reader that tails the log passes the last `Removal.at` it saw). A malformed record
    (damage) is skipped: the log is advice, the blocks themselves are checked on read."""
    cur = txn.cursor(db=removed_db)
    start = nsb + max(0, after + 1).to_bytes(SEQ_BYTES, "big")
    if not cur.set_range(start):
        return
    for k, v in cur.iternext(values=True):
        k = bytes(k)
        if not k.startswith(nsb):
            return
        try:
            yield from decode(k, v)
        except ValueError:
            continue


class Tail:
    """A reader's place in one namespace's removal log, from its newest record at the start:
    `take(txn)` gives the removals committed since the last call, oldest first (hold `lock`
    around it where several threads take)."""

    def __init__(self, txn: lmdb.Transaction, removed_db: Any, nsb: bytes) -> None:
        self._db, self._nsb = removed_db, nsb
        self.lock = threading.Lock()
        self.at = -1  # the newest record read (-1: none yet)
        cur = txn.cursor(db=removed_db)
        after = int.from_bytes(nsb, "big") + 1
        found = after < 1 << 8 * NS_BYTES and cur.set_range(after.to_bytes(NS_BYTES, "big"))
        if (cur.prev() if found else cur.last()) and bytes(cur.key()).startswith(nsb):
            self.at = int.from_bytes(bytes(cur.key())[NS_BYTES:], "big")

    def take(self, txn: lmdb.Transaction) -> list[Removal]:
        new = list(read(txn, self._db, self._nsb, self.at))
        if new:
            self.at = new[-1].at
        return new
