"""The index image (`index.img`): what an open would learn from the journal and every slot
header, as fixed-width arrays, checksummed as a whole. `encode_image` / `decode_image`."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import xxhash

from tiercache.tiers.base import KEY_BYTES
from tiercache.tiers.nvme.journal import KEY_DTYPE, REC_SIZE, REC_SUM, Entries

# Header: magic, version, flags (bit 0: the writer's namespace is set;
# bit 1: one entry per namespace and key, written so by a compaction that checked it),
# journal bytes covered, xxh3_64 of those bytes, top seq, writer namespace id, slots in the
# slab, entries, namespaces; then the namespace table (u64 each), then per entry (oldest
# first) slot u32, seq u64, namespace number u32, key 16 bytes; then xxh3_64 of all before.
_IMG_MAGIC, _IMG_VERSION = b"TIMG", 1
_IMG_HEAD = struct.Struct("<4sHHQQQQQII")
_IMG_WRITER, _IMG_DISTINCT = 1, 2


@dataclass(frozen=True, slots=True)
class IndexImage:
    covered: int  # journal bytes it covers (a record boundary)
    journal_hash: int  # xxh3_64 of those bytes
    top_seq: int
    writer: int | None  # namespace id of the tier that appends after `covered`
    slots: np.ndarray  # u32
    seqs: np.ndarray  # u64
    ns: np.ndarray  # u64 namespace id per entry
    keys: np.ndarray  # V16
    distinct: bool  # one entry per (namespace, key): an open need not look for copies


def encode_image(
    journal: bytes,
    top_seq: int,
    writer: int | None,
    nslots: int,
    entries: Entries,
    *,
    distinct: bool = False,
) -> bytes:
    """The image of `entries` (oldest first) covering all of `journal`; `distinct`: the
    caller checked that they hold one entry per namespace and key."""
    n = len(entries)
    table, number = np.unique(entries.ns, return_inverse=True)
    head = _IMG_HEAD.pack(
        _IMG_MAGIC,
        _IMG_VERSION,
        (_IMG_WRITER if writer is not None else 0) | (_IMG_DISTINCT if distinct else 0),
        len(journal),
        xxhash.xxh3_64_intdigest(journal),
        top_seq,
        writer or 0,
        nslots,
        n,
        len(table),
    )
    body = b"".join(
        [
            head,
            table.astype("<u8").tobytes(),
            entries.slots.astype("<u4").tobytes(),
            entries.seqs.astype("<u8").tobytes(),
            number.astype("<u4").tobytes(),
            entries.keys.tobytes(),
        ]
    )
    return body + REC_SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_image(data: bytes) -> IndexImage | None:
    """The image in `data`, or None when it is damaged, foreign or of another version."""
    if len(data) < _IMG_HEAD.size + REC_SUM.size:
        return None
    body = memoryview(data)[: -REC_SUM.size]
    (digest,) = REC_SUM.unpack_from(data, len(body))
    if xxhash.xxh3_64_intdigest(body) != digest:
        return None
    magic, version, flags, covered, jhash, top, writer, _nslots, n, nt = _IMG_HEAD.unpack_from(data)
    if magic != _IMG_MAGIC or version != _IMG_VERSION or covered % REC_SIZE:
        return None
    off = _IMG_HEAD.size
    if len(body) != off + 8 * nt + (4 + 8 + 4 + KEY_BYTES) * n:
        return None
    table = np.frombuffer(data, dtype="<u8", count=nt, offset=off)
    off += 8 * nt
    slots = np.frombuffer(data, dtype="<u4", count=n, offset=off)
    seqs = np.frombuffer(data, dtype="<u8", count=n, offset=off + 4 * n)
    number = np.frombuffer(data, dtype="<u4", count=n, offset=off + 12 * n)
    if n and int(number.max()) >= nt:
        return None
    keys = np.frombuffer(data, dtype=KEY_DTYPE, count=n, offset=off + 16 * n)
    return IndexImage(
        covered,
        jhash,
        top,
        writer if flags & _IMG_WRITER else None,
        slots,
        seqs,
        table[number] if n else np.zeros(0, dtype="<u8"),
        keys,
        bool(flags & _IMG_DISTINCT),
    )
