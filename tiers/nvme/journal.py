"""The index journal: its fixed 40-byte records, the array form of index entries, and the
one replay rule (per slot the newest record wins; of equal seqs the first).

Primitives:
- `pack_record(op, slot, seq, key)` / `parse_record(buf, off)`: one record, built / checked alone.
- `Entries`: index entries as parallel fixed-width arrays (no Python object per block).
- `put_records(entries)`: the PUT records of a compaction, as one array.
- `tail_records(data)`: THE replay rule, vectorised: the newest well-formed PUT or FREE record
  per slot, damaged count, top seq (an image's tail; `replay_journal` is built on it).
- `newest_per_key(entries)`: per (namespace, key) the entry of highest seq, as arrays.
- `newest_copies(items, ident, seq)`: THE "newest copy per identity" rule (highest seq, the
  first of equal seqs): `newest_per_key`, `replay_journal` and the CLI's listing apply it.
- `replay_journal(data, capacity)`: the live entries of a whole journal, with a report.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import xxhash

from tiercache.tiers.base import KEY_BYTES

OP_PUT, OP_FREE, OP_BASE = 1, 2, 3
_REC_MAGIC, _REC_VERSION = b"TJ", 1
_REC = struct.Struct("<2sBBIQ16s")  # magic, version, op, slot, seq, key
REC_SUM = struct.Struct("<Q")  # xxh3_64 of the 32 bytes above
REC_SIZE = _REC.size + REC_SUM.size  # 40
NO_KEY = bytes(KEY_BYTES)


def pack_record(op: int, slot: int, seq: int, key: bytes) -> bytes:
    body = _REC.pack(_REC_MAGIC, _REC_VERSION, op, slot, seq, key)
    return body + REC_SUM.pack(xxhash.xxh3_64_intdigest(body))


def parse_record(buf: bytes, off: int) -> tuple[int, int, int, bytes] | None:
    """(op, slot, seq, key) of the record at `off`, or None when it is damaged."""
    body = buf[off : off + _REC.size]
    (digest,) = REC_SUM.unpack_from(buf, off + _REC.size)
    if xxhash.xxh3_64_intdigest(body) != digest:
        return None
    magic, version, op, slot, seq, key = _REC.unpack(body)
    if magic != _REC_MAGIC or version != _REC_VERSION or op not in (OP_PUT, OP_FREE, OP_BASE):
        return None
    return op, slot, seq, key


KEY_DTYPE = np.dtype(f"V{KEY_BYTES}")
# A journal record's first 32 bytes as a numpy row (the layout of _REC, little-endian).
_REC_ROW = np.dtype(
    [
        ("magic", "S2"),
        ("version", "u1"),
        ("op", "u1"),
        ("slot", "<u4"),
        ("seq", "<u8"),
        ("key", KEY_DTYPE),
    ]
)
assert _REC_ROW.itemsize == _REC.size


_REC_FULL = np.dtype([("body", _REC_ROW), ("sum", "<u8")])
assert _REC_FULL.itemsize == REC_SIZE


@dataclass(frozen=True, slots=True)
class Entries:
    """Index entries as parallel fixed-width arrays (one row per block): what the image
    holds, what an open settles and what a compaction writes; no Python object per block."""

    slots: np.ndarray  # int64
    keys: np.ndarray  # V16
    seqs: np.ndarray  # uint64
    ns: np.ndarray  # uint64 namespace id

    @classmethod
    def of(cls, items: Sequence[tuple[int, bytes, int, int]]) -> Entries:
        """From (slot, key, seq, namespace id) tuples (the slow paths: a full replay)."""
        n = len(items)
        return cls(
            np.fromiter((e[0] for e in items), dtype=np.int64, count=n),
            np.frombuffer(b"".join(e[1] for e in items), dtype=KEY_DTYPE).copy(),
            np.fromiter((e[2] for e in items), dtype=np.uint64, count=n),
            np.fromiter((e[3] for e in items), dtype=np.uint64, count=n),
        )

    def take(self, idx: np.ndarray) -> Entries:
        return Entries(self.slots[idx], self.keys[idx], self.seqs[idx], self.ns[idx])

    def join(self, more: Entries) -> Entries:
        """These entries, then `more`."""
        cols = ("slots", "keys", "seqs", "ns")
        return Entries(*(np.concatenate([getattr(self, f), getattr(more, f)]) for f in cols))

    def __len__(self) -> int:
        return len(self.slots)


def put_records(e: Entries) -> bytes:
    """PUT records of `e`, in its order: the bodies built as one array, only the per-record
    xxh3 in a Python loop."""
    n = len(e)
    rows = np.zeros(n, dtype=_REC_ROW)
    rows["magic"], rows["version"], rows["op"] = _REC_MAGIC, _REC_VERSION, OP_PUT
    rows["slot"], rows["seq"], rows["key"] = e.slots, e.seqs, e.keys
    body = rows.tobytes()
    sums = _digests(body, _REC.size, n)
    out = np.empty((n, REC_SIZE), dtype=np.uint8)
    out[:, : _REC.size] = rows.view(np.uint8).reshape(n, _REC.size)
    out[:, _REC.size :] = sums.view(np.uint8).reshape(n, REC_SUM.size)
    return out.tobytes()


def _digests(data: bytes | memoryview, stride: int, n: int) -> np.ndarray:
    """The xxh3 of the record body at every `stride` bytes of `data`, `n` of them."""
    view, digest = memoryview(data), xxhash.xxh3_64_intdigest
    it = (digest(view[o : o + _REC.size]) for o in range(0, n * stride, stride))
    return np.fromiter(it, dtype="<u8", count=n)


def _winners(data: bytes | memoryview) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """The replay rule on a run of records: their bodies as rows, the positions of the
    well-formed PUT and FREE records, of those the winner per slot (the highest seq; of equal
    seqs the first record), by slot, how many records were damaged (a torn end counts one)
    and the highest seq of any well-formed record. Every record's checksum is verified (one
    xxh3 call each, the rest as arrays)."""
    n = len(data) // REC_SIZE
    damaged = int(len(data) % REC_SIZE != 0)
    recs = np.frombuffer(data, dtype=_REC_FULL, count=n)
    sums = _digests(data, REC_SIZE, n)
    body = recs["body"]
    ok = (
        (sums == recs["sum"])
        & (body["magic"] == _REC_MAGIC)
        & (body["version"] == _REC_VERSION)
        & np.isin(body["op"], (OP_PUT, OP_FREE, OP_BASE))
    )
    damaged += n - int(ok.sum())
    good = np.flatnonzero(ok & (body["op"] != OP_BASE))
    top = body["seq"][ok]
    slot, seq = body["slot"][good].astype(np.int64), body["seq"][good]
    # By slot, then seq, then position backwards: each slot's last row is its winner.
    order = np.lexsort((-good, seq, slot))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = slot[order][1:] != slot[order][:-1]
    return body, good, good[order[last]], damaged, int(top.max(initial=0))


def tail_records(tail: bytes | memoryview) -> tuple[Entries, int, int]:
    """`_winners` of a journal tail as arrays (`ns` holds each record's op), how many
    records were damaged and the highest seq of any well-formed record."""
    body, _good, win, damaged, top = _winners(tail)
    t = Entries(
        body["slot"][win].astype(np.int64),
        body["key"][win],
        body["seq"][win].astype(np.uint64),
        body["op"][win].astype(np.uint64),
    )
    return t, damaged, top


def newest_per_key(e: Entries) -> np.ndarray:
    """Which entries to keep: per (namespace, key) the one of highest seq (the first of
    equal seqs). Keys are hashes, so a 64-bit mix of key and namespace finds candidates with
    one sort; only those (normally none) are compared whole, in Python."""
    n = len(e)
    keep = np.ones(n, dtype=bool)
    if n < 2:
        return keep
    k = e.keys.view("<u8").reshape(n, 2)
    h = k[:, 0] ^ (k[:, 1] * np.uint64(0x9E3779B97F4A7C15)) ^ e.ns
    order = np.argsort(h, kind="stable")
    hs = h[order]
    dup = np.flatnonzero(hs[1:] == hs[:-1])
    if not dup.size:
        return keep
    maybe = np.unique(np.concatenate([order[dup], order[dup + 1]])).tolist()
    best, _ = newest_copies(maybe, lambda i: (int(e.ns[i]), e.keys[i].tobytes()), e.seqs.item)
    keep[maybe] = False
    keep[list(best.values())] = True
    return keep


T = TypeVar("T")


def newest_copies(
    items: Sequence[T], ident: Callable[[T], Hashable], seq: Callable[[T], int]
) -> tuple[dict[Hashable, T], int]:
    """Per identity the item of highest seq (the first of equal seqs), keyed by identity in
    the order identities first appear, and how many items were left out (superseded)."""
    best: dict[Hashable, T] = {}
    for item in items:
        k = ident(item)
        if seq(item) > seq(best.setdefault(k, item)):
            best[k] = item
    return best, len(items) - len(best)


def compacted(
    live: Entries, kept: Sequence[tuple[int, bytes, int, int]], top_seq: int
) -> tuple[Entries, bytes]:
    """What a compaction writes: `live` and `kept` (slot, key, seq, namespace id) merged oldest
    first, and the journal that holds them: BASE (the sequence counter) + one PUT each."""
    entries = live
    if kept:
        both = live.join(Entries.of(kept))
        entries = both.take(np.argsort(both.seqs, kind="stable"))
    return entries, pack_record(OP_BASE, 0, top_seq, NO_KEY) + put_records(entries)


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """A block the index journal names: `key` written into `slot` at write sequence `seq`."""

    slot: int
    key: bytes
    seq: int


@dataclass(frozen=True, slots=True)
class JournalReport:
    """What a replay of the index journal found, before any slot header is read."""

    records: int  # whole records in the file
    damaged: int  # records failing their checksum or format, plus a torn tail
    out_of_range: int  # PUTs naming a slot beyond the capacity
    superseded: int  # live PUTs of a key that a newer PUT put in another slot
    top_seq: int


def replay_journal(
    data: bytes, capacity: int, *, per_key: bool = True
) -> tuple[list[JournalEntry], JournalReport]:
    """The live entries of a journal image in slots below `capacity` (per slot the highest
    seq wins; with `per_key`, one slot per key, the newest: a lost FREE record can leave an
    older copy behind), oldest first, with counts of what was skipped. Reads no slot."""
    body, good, win, damaged, top = _winners(data)
    # The winners in the order their slots first appear in the journal (the order a replay
    # record by record meets them): it decides ties below and in the final sort.
    slots = body["slot"][good]
    by_slot = np.lexsort((good, slots))
    first = np.ones(len(by_slot), dtype=bool)
    first[1:] = slots[by_slot][1:] != slots[by_slot][:-1]
    win = win[np.argsort(good[by_slot[first]], kind="stable")]
    best = zip(
        body["slot"][win].tolist(),
        body["seq"][win].tolist(),
        body["op"][win].tolist(),
        body["key"][win].tolist(),
        strict=True,
    )
    puts = [JournalEntry(slot, key, seq) for slot, seq, op, key in best if op == OP_PUT]
    live = [e for e in puts if e.slot < capacity]
    out_of_range, superseded = len(puts) - len(live), 0
    if per_key:
        newest, superseded = newest_copies(live, lambda e: e.key, lambda e: e.seq)
        live = list(newest.values())
    entries = sorted(live, key=lambda e: e.seq)
    return entries, JournalReport(len(data) // REC_SIZE, damaged, out_of_range, superseded, top)
