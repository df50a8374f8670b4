"""What an LMDB tier indexes at open: its namespace's newest `capacity` blocks, found from
the "order" entries and checked by header only (no payload is read: a read verifies it).

- `scan`: the open-time scan. A lazy tier over a well-formed store indexes nothing
  (`open_lazily`); else a well-formed namespace is read in bulk (`scan_fast`), and any
  malformed entry sends the open to the entry-by-entry walk, which drops exactly those
  (`malformed`). Opening deletes no good block.
- `Scope`: what a scan is for (path, namespace, capacity, block size). The tier hands in its
  header check, transaction and commit functions, so this module never imports the tier."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lmdb
import numpy as np

from tiercache.errors import BlockCorruptError, ConfigError
from tiercache.tiers.base import KEY_BYTES
from tiercache.tiers.format import (
    CODEC_RAW,
    CODEC_ZSTD_SHUFFLE2,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
)
from tiercache.tiers.lmdb.env import SharedEnv, damaged
from tiercache.tiers.lmdb.layout import (
    COUNT_PREFIX,
    EVICTS_LATER,
    NS_BYTES,
    SEQ_BYTES,
    SEQ_KEY,
    head_seq,
    iter_prefix,
    seq_bytes,
    u64,
)
from tiercache.tiers.store_dir import over_capacity, warn_over_capacity

log = logging.getLogger("tiercache.tiers.lmdb")  # the package's one logger name

# Rows of `scan_fast`: an "order" entry (key, value) and a "heads" entry (store key, the
# `tiers.format` header, the 8-byte order seq), little-endian fields as the header packs them.
_ORDER_ROW = np.dtype([("ns", "V8"), ("seq", ">u8"), ("key", f"V{KEY_BYTES}")])
_HEADS_ROW = np.dtype(
    [
        ("ns", "V8"),
        ("key", f"V{KEY_BYTES}"),
        ("magic", "V4"),
        ("version", "<u2"),
        ("codec", "u1"),
        ("reserved", "u1"),
        ("hkey", f"V{KEY_BYTES}"),
        ("hns", "<u8"),
        ("raw", "<u4"),
        ("stored", "<u4"),
        ("hseq", "<u8"),
        ("reserved2", "<u8"),
        ("sum", "<u8"),
        ("oseq", ">u8"),
    ]
)
assert _HEADS_ROW.itemsize == NS_BYTES + KEY_BYTES + HEADER_SIZE + SEQ_BYTES


@dataclass(frozen=True)
class Scope:
    """What a scan is for: the store at `path`, the namespace with id `ns`, a tier of
    `capacity` blocks of `block_bytes`."""

    path: str
    ns: int
    capacity: int
    block_bytes: int

    @property
    def nsb(self) -> bytes:
        """The namespace prefix of every store key of ours."""
        return self.ns.to_bytes(NS_BYTES, "big")


@dataclass(frozen=True)
class Scanned:
    """What `scan` found: block keys to index (oldest first) and the open report."""

    keys: list[bytes]
    report: dict[str, int]


def scan(
    shared: SharedEnv,
    scope: Scope,
    *,
    lazy: bool,
    check: Callable[[bytes, Any, int], Any],
    begin: Callable[[bool], lmdb.Transaction],
    commit: Callable[[], None],
) -> Scanned:
    """Index this namespace's newest `capacity` blocks, walking its "order" entries newest
    first and checking each header and its payload's length (py-lmdb's zero-copy get
    touches no payload page). Only when the databases disagree in size (an entry without
    its partner) are this namespace's entries scanned to find and drop the malformed ones.

    `check(key, head, payload_len)`: the tier's header check (BlockCorruptError when `head`
    is not the header of `key` in this namespace, of this block and payload size);
    `begin(write)`: a transaction of the tier (default db: blocks); `commit()`: applies the
    tier's pending deletes (the malformed entries found go there)."""
    nsb = scope.nsb
    kept: list[bytes] = []  # block keys, newest first
    bad: dict[bytes, int | None] = {}
    fast: list[bytes] | None = None
    txn = begin(False)
    try:
        sizes = [txn.stat(db)["entries"] for db in (shared.heads, shared.blocks)]
        sizes.append(txn.stat(shared.order)["entries"])
        count = u64(txn.get(COUNT_PREFIX + nsb, db=shared.meta))
        with shared.state_lock:  # the next write's order seq is past every one stored
            shared.seq = max(shared.seq, u64(txn.get(SEQ_KEY, db=shared.meta)))
        if len(set(sizes)) > 1:
            bad.update(malformed(txn, shared, scope, check))
        elif lazy:  # well formed: nothing to index (see LMDBTier.__init__)
            return open_lazily(shared, scope, count)
        fast = None if bad else scan_fast(txn, shared, scope)
        cur = txn.cursor(db=shared.order)
        if fast is not None:
            kept, at = fast, None  # newest first, like the walk below
        elif nsb == b"\xff" * NS_BYTES:
            at = cur.last()
        elif cur.set_range((int.from_bytes(nsb, "big") + 1).to_bytes(NS_BYTES, "big")):
            at = cur.prev()  # the last entry before the next namespace's first
        else:
            at = cur.last()
        while at and len(kept) < scope.capacity:
            ok = bytes(cur.key())
            if not ok.startswith(nsb):
                break
            key, sk = bytes(cur.value()), nsb + bytes(cur.value())
            at = cur.prev()
            head = txn.get(sk, db=shared.heads)
            if head is None or sk in bad:
                continue  # a stale order entry (the next eviction passing it drops it)
            if head_seq(head) != int.from_bytes(ok[NS_BYTES:], "big"):
                bad[sk] = head_seq(head)  # the entries disagree: damage (the seq is not
                continue  # covered by the checksum), never written so by a tier
            v = txn.get(sk)
            try:
                if v is None or len(key) != KEY_BYTES:
                    raise BlockCorruptError("no payload")
                check(key, head, len(v))
            except BlockCorruptError:
                bad[sk] = head_seq(head)
                continue
            kept.append(key)
    except lmdb.Error as exc:
        raise ConfigError("path", damaged(scope.path, exc)) from None
    finally:
        txn.abort()
    if bad:
        log.warning("%s: dropping %d malformed entries found at open", scope.path, len(bad))
        shared.pend(bad)
        commit()
    held = count - len(bad)  # the malformed entries just dropped are not held
    excess = over_capacity(held, scope.capacity)
    then = "indexing the newest; " + EVICTS_LATER
    warn_over_capacity(log, scope.path, held, scope.capacity, excess, then)
    report = {
        "bulk_scan": int(fast is not None),
        "blocks_dropped": len(bad),
        "blocks_over_capacity": excess,
        "blocks_recovered": len(kept),
    }
    kept.reverse()
    return Scanned(kept, report)


def open_lazily(shared: SharedEnv, scope: Scope, count: int) -> Scanned:
    """`scan` of a well-formed store by a lazy tier: index nothing (lookups find blocks by
    `probe`; the store evicts beyond `capacity` at its next write of this namespace)."""
    excess = over_capacity(count, scope.capacity)
    warn_over_capacity(log, scope.path, count, scope.capacity, excess, EVICTS_LATER)
    report = {
        "bulk_scan": 0,
        "lazy": 1,
        "blocks_dropped": 0,
        "blocks_over_capacity": excess,
        "blocks_recovered": 0,
        "blocks_in_store": count,
    }
    if count:
        shared.start_warm()
    return Scanned([], report)


def scan_fast(txn: lmdb.Transaction, shared: SharedEnv, scope: Scope) -> list[bytes] | None:
    """`scan`'s walk for a well-formed namespace, in bulk: its "order" and "heads"
    entries are read by two cursor runs into fixed-width arrays and checked as arrays
    (every header's fields, and each header's order seq naming an order entry of its
    key); no payload is looked at (a read verifies it). The newest `capacity` block
    keys, newest first; None, and the caller walks entry by entry, when any entry is
    malformed."""
    nsb = scope.nsb

    def run(db: Any, klen: int, vlen: int) -> bytes | None:
        """The namespace's entries of `db`, each key + value copied out in runs of
        4096 (not holding py-lmdb's buffers), joined; None when one has another length."""
        cur = txn.cursor(db=db)
        if not cur.set_range(nsb):
            return b""
        parts: list[bytes] = []
        it = cur.iternext(keys=True, values=True)
        while True:  # the run that passes our prefix is the last
            got = [
                bytes(k) + bytes(v) if len(k) == klen else b""
                for k, v in itertools.islice(it, 4096)
            ]
            if set(map(len, got)) - {klen + vlen}:
                return None
            parts.append(b"".join(got))
            if len(got) < 4096 or got[-1][:NS_BYTES] != nsb:
                break
        rows = np.frombuffer(b"".join(parts), dtype=f"V{klen + vlen}")
        ours = rows.view(np.uint8).reshape(len(rows), klen + vlen)[:, :NS_BYTES]
        mine = (ours == np.frombuffer(nsb, dtype=np.uint8)).all(axis=1)
        end = len(rows) if mine.all() else int(np.argmin(mine))  # sorted: a prefix
        return rows[:end].tobytes()

    order = run(shared.order, NS_BYTES + SEQ_BYTES, KEY_BYTES)
    heads = run(shared.heads, NS_BYTES + KEY_BYTES, HEADER_SIZE + SEQ_BYTES)
    if order is None or heads is None:
        return None
    o = np.frombuffer(order, dtype=_ORDER_ROW)
    h = np.frombuffer(heads, dtype=_HEADS_ROW)
    codec = h["codec"]
    good = (
        (h["magic"] == np.frombuffer(MAGIC, dtype="V4")[0])
        & (h["version"] == FORMAT_VERSION)
        & (codec <= CODEC_ZSTD_SHUFFLE2)
        & ((codec != CODEC_RAW) | (h["stored"] == h["raw"]))
        & ((codec != CODEC_ZSTD_SHUFFLE2) | (h["raw"] % 2 == 0))
        & (h["key"] == h["hkey"])
        & (h["hns"] == scope.ns)
        & (h["raw"] == scope.block_bytes)
    )
    seqs, oseq = o["seq"].astype(np.uint64), h["oseq"].astype(np.uint64)
    if len(seqs) > 1 and not bool(np.all(seqs[1:] > seqs[:-1])):
        return None
    by_age = np.argsort(oseq, kind="stable")
    if len(o) == len(h):  # one order entry per header: pair them up in seq order
        good[by_age] &= (seqs == oseq[by_age]) & (o["key"] == h["key"][by_age])
    elif len(o):  # stale order entries too (skipped, as the walk skips them)
        at = np.minimum(np.searchsorted(seqs, oseq), len(o) - 1)
        good &= (seqs[at] == oseq) & (o["key"][at] == h["key"])
    else:
        good &= False
    if not bool(good.all()):
        return None
    return h["key"][by_age[::-1][: scope.capacity]].tolist()


def malformed(
    txn: lmdb.Transaction,
    shared: SharedEnv,
    scope: Scope,
    check: Callable[[bytes, Any, int], Any],
) -> dict[bytes, int | None]:
    """Store keys of this namespace whose entries are malformed or incomplete (a header
    without payload or order entry, a payload without header), with their order seq."""
    nsb = scope.nsb
    bad: dict[bytes, int | None] = {}
    for sk, head in iter_prefix(txn.cursor(db=shared.heads), nsb, values=True):
        key, seq = sk[NS_BYTES:], head_seq(head)
        v = txn.get(sk)
        try:
            if v is None or len(key) != KEY_BYTES or seq is None:
                raise BlockCorruptError("no payload")
            if txn.get(nsb + seq_bytes(seq), db=shared.order) != key:
                raise BlockCorruptError("no order entry")
            check(key, head, len(v))
        except BlockCorruptError:
            bad[sk] = seq
    for sk in iter_prefix(txn.cursor(), nsb, values=False):
        if txn.get(sk, db=shared.heads) is None:
            bad[sk] = None
    return bad
