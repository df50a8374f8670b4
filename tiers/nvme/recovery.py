"""Recovery of an NVMe store's index at open, as pure functions over the journal's bytes,
the decoded image and the slot headers already read (no file, no tier, no log):

- `image_matches(img, journal)`: the image covers this journal's first bytes unchanged.
- `from_image(img, journal, slab_slots)`: the image's entries with the journal tail after it
  replayed over them (the one replay rule, `journal.tail_records`), or None.
- `header_ns(header, got, key, seq, block_bytes)`: a slot header's namespace if it agrees
  with its journal entry (the full replay's check).
- `settle(entries, ...)`: which entries are the tier's (up to its capacity) and which are
  kept, its free slots and the open report: a `Recovered`.
- `place(used, kept, capacity)`: the free slots and the slab's size in slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from tiercache.errors import BlockCorruptError
from tiercache.tiers.format import CODEC_RAW, HEADER_SIZE, header_of
from tiercache.tiers.nvme.image import IndexImage
from tiercache.tiers.nvme.journal import KEY_DTYPE, OP_PUT, Entries, newest_per_key, tail_records
from tiercache.tiers.store_dir import over_capacity


@dataclass(frozen=True, slots=True)
class Replayed:
    """Index entries an open learned, before they are settled, and what it skipped."""

    entries: Entries
    damaged: int  # journal records that failed their checks (a torn end counts one)
    dropped: int  # entries already dropped (past the slab's end, bad headers)
    top_seq: int
    distinct: bool  # known to hold one entry per namespace and key
    tail: int = 0  # journal bytes after the image (0: the image covers all of it)


@dataclass(frozen=True, slots=True)
class Recovered:
    """A settled index: what the tier adopts at open."""

    seqs: np.ndarray  # uint64 per slot of the slab: the write seq, 0 for none of ours
    keys: np.ndarray  # V16 per slot
    live: int  # slots with a nonzero seq
    kept: dict[int, tuple[bytes, int, int]]  # slot -> (key, seq, namespace id), not ours
    ns_of: dict[int, int] | None  # slot -> namespace id, only for namespace None
    free: np.ndarray  # the free slots, ascending
    nslots: int  # slots in the slab: ours (capacity) + kept
    top_seq: int
    report: dict[str, int]
    ours: int  # blocks of this namespace found, over the capacity or not


def image_matches(img: IndexImage, journal: bytes) -> bool:
    """Whether the image covers the first bytes of `journal` as they are (else it is stale,
    or the journal was damaged)."""
    return img.covered <= len(journal) and (
        xxhash.xxh3_64_intdigest(memoryview(journal)[: img.covered]) == img.journal_hash
    )


def from_image(img: IndexImage, journal: bytes, cap: int) -> Replayed | None:
    """The entries of `img` with the journal records after it replayed over them, in a slab
    of `cap` slots; None when the tail puts blocks and the image names no writer (then the
    caller reads every header). `img` must match `journal` (`image_matches`).

    The tail needs no header check: its PUTs were written by the image's writer (every open
    and every compaction writes a fresh image), and a read verifies key, namespace and
    checksum, so an entry whose data never landed is a miss there, never bytes."""
    tail = memoryview(journal)[img.covered :]
    t, damaged, tail_top = tail_records(tail)
    top = max(img.top_seq, tail_top)
    puts = t.ns == OP_PUT  # `ns` holds each record's op here
    if img.writer is None and bool(puts.any()):
        return None  # the tail's PUTs have no known namespace
    writer = np.uint64(img.writer or 0)
    slots = img.slots.astype(np.int64)
    seqs, ns, keys = img.seqs.copy(), img.ns.copy(), img.keys.copy()
    # One entry per slot, the image's last (as a slot map would keep it); entries past
    # the slab's end go to `extra` (dropped below, after the tail had its say).
    alive = slots < cap
    inside = np.flatnonzero(alive)
    pos = np.full(cap, -1, dtype=np.int64)
    pos[slots[inside]] = inside  # a repeated slot: the last assignment stays
    alive[inside] = pos[slots[inside]] == inside
    extra: dict[int, tuple[bytes, int, int]] = {}
    for i in np.flatnonzero(slots >= cap).tolist():
        extra[int(slots[i])] = (keys[i].tobytes(), int(seqs[i]), int(ns[i]))
    # The tail's newest record per slot decides, where it is newer than the image's.
    near = t.slots < cap
    at = np.where(near, pos[np.minimum(t.slots, max(cap - 1, 0))] if cap else -1, -1)
    has = at >= 0
    held = np.zeros(len(t), dtype=np.uint64)
    held[has] = seqs[at[has]]
    newer = ~has | (held < t.seqs)
    over = near & has & newer
    put_over = np.flatnonzero(over & puts)
    keys[at[put_over]], seqs[at[put_over]] = t.keys[put_over], t.seqs[put_over]
    ns[at[put_over]] = writer
    alive[at[np.flatnonzero(over & ~puts)]] = False
    add = t.take(np.flatnonzero(near & ~has & puts))
    add = Entries(add.slots, add.keys, add.seqs, np.full(len(add), writer, dtype=np.uint64))
    for j in np.flatnonzero(~near).tolist():  # slots past the slab's end (normally none)
        slot, seq = int(t.slots[j]), int(t.seqs[j])
        cur = extra.get(slot)
        if cur is not None and cur[1] >= seq:
            continue
        if puts[j]:
            extra[slot] = (t.keys[j].tobytes(), seq, int(writer))
        else:
            extra.pop(slot, None)
    entries = Entries(slots, keys, seqs, ns).take(np.flatnonzero(alive))
    if len(add):
        entries = entries.join(add)
    # Tail PUTs may name a key the image holds in another slot (a lost FREE record);
    # FREE records only remove entries.
    distinct = img.distinct and not len(put_over) and not len(add)
    return Replayed(entries, damaged, len(extra), top, distinct, len(tail))


def header_ns(
    header: memoryview | bytes, got: int, key: bytes, seq: int, block_bytes: int
) -> int | None:
    """The namespace id of a slot's header (`got` bytes read) if it agrees with its journal
    entry: key, seq, a raw block of `block_bytes`; else None."""
    if got < HEADER_SIZE:
        return None
    try:
        h = header_of(header[:HEADER_SIZE], key, None, block_bytes)
    except BlockCorruptError:
        return None
    return h.namespace_id if h.seq == seq and h.codec == CODEC_RAW else None


def settle(
    e: Entries,
    *,
    ns: int | None,
    capacity: int,
    skipped: int,
    dropped: int,
    top_seq: int,
    distinct: bool = False,
) -> Recovered:
    """Index entries settled for a tier of namespace `ns` (None: every namespace's, an
    offline view) and `capacity`: its own up to the capacity (the newest), the rest kept.
    `skipped`: damaged records; `dropped`: entries already dropped; `distinct`: the entries
    are known to hold one per namespace and key. Array operations only, but for duplicate
    keys and kept blocks (normally none)."""
    # One slot per (namespace, key), the newest: a lost FREE record can leave an older
    # copy behind. Equal keys of two namespaces are two blocks.
    given = len(e)
    if not distinct:
        e = e.take(np.flatnonzero(newest_per_key(e)))
    mine = np.ones(len(e), dtype=bool) if ns is None else e.ns == np.uint64(ns)
    ours = np.flatnonzero(mine)
    if not bool(np.all(e.seqs[ours][1:] > e.seqs[ours][:-1])):  # an image is in order
        ours = ours[np.argsort(e.seqs[ours], kind="stable")]  # oldest first
    over = over_capacity(len(ours), capacity)
    used = e if over == 0 and len(ours) == len(e) else e.take(ours[over:])
    kept = e.take(np.concatenate([np.flatnonzero(~mine), ours[:over]]))
    kept_map = {
        s: (k, q, n)
        for s, k, q, n in zip(
            kept.slots.tolist(),
            kept.keys.tolist(),
            kept.seqs.tolist(),
            kept.ns.tolist(),
            strict=True,
        )
    }
    ns_of = dict(zip(e.slots.tolist(), e.ns.tolist(), strict=True)) if ns is None else None
    free, nslots = place(used.slots, kept.slots, capacity)
    seqs = np.zeros(nslots, dtype=np.uint64)
    keys = np.zeros(nslots, dtype=KEY_DTYPE)
    seqs[used.slots] = used.seqs
    keys[used.slots] = used.keys
    report = {
        "records_skipped": skipped,
        # bad headers, stale copies of a key, slots past the slab's end
        "blocks_dropped": dropped + given - len(e),
        "blocks_recovered": len(used),
        "blocks_over_capacity": over,
        "blocks_of_other_namespaces": len(kept) - over,
    }
    return Recovered(
        seqs, keys, len(used), kept_map, ns_of, free, nslots, top_seq, report, len(ours)
    )


def place(used: np.ndarray, kept: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """A tier's free slots, ascending: the lowest ones that hold neither one of its blocks
    (`used`) nor a kept one, as many as its `capacity` leaves; and the slots the slab must
    hold, so that it covers them and every held slot."""
    top = int(max(used.max(initial=-1), kept.max(initial=-1))) + 1
    need = max(0, capacity - len(used))
    taken = np.zeros(top + need, dtype=bool)
    taken[used] = True
    taken[kept] = True
    free = np.flatnonzero(~taken)[:need]
    return free, max(int(free[-1]) + 1 if need else 0, top)
