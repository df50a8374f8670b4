"""The NVMe tier's open-time recovery as pure functions (tiers/nvme/recovery.py), tested on
bytes and arrays alone: no slab file, no tier. And the journal replay held equal to its
record-by-record specification."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.tiers.format import encode_block
from tiercache.tiers.nvme import recovery
from tiercache.tiers.nvme.image import decode_image, encode_image
from tiercache.tiers.nvme.journal import (
    NO_KEY,
    OP_BASE,
    OP_FREE,
    OP_PUT,
    REC_SIZE,
    Entries,
    JournalEntry,
    JournalReport,
    pack_record,
    parse_record,
    replay_journal,
)

A, B = 11, 22  # two namespace ids


def key(i: int) -> bytes:
    return bytes([i]) * 16


def entries(*rows: tuple[int, int, int, int]) -> Entries:
    """From (slot, key number, seq, namespace) rows."""
    return Entries.of([(s, key(k), q, n) for s, k, q, n in rows])


def test_place_hands_out_the_lowest_slots_no_block_holds() -> None:
    free, nslots = recovery.place(np.array([0, 3]), np.array([5]), capacity=4)
    assert free.tolist() == [1, 2]  # 4 - 2 used: two free slots, the lowest untaken
    assert nslots == 6  # the slab covers the kept block in slot 5


def test_settle_keeps_other_namespaces_and_the_oldest_over_capacity() -> None:
    e = entries((0, 1, 5, A), (1, 2, 6, B), (2, 3, 7, A), (3, 4, 8, A))
    r = recovery.settle(e, ns=A, capacity=2, skipped=1, dropped=0, top_seq=9)
    # Ours: slots 0, 2, 3 (seqs 5, 7, 8); capacity 2 keeps the newest two in use.
    assert np.flatnonzero(r.seqs).tolist() == [2, 3]
    assert r.keys[3].tobytes() == key(4) and r.live == 2
    # The oldest of ours and the other namespace's block are kept, not used.
    assert r.kept == {0: (key(1), 5, A), 1: (key(2), 6, B)}
    assert r.free.tolist() == [] and r.nslots == 4 and r.top_seq == 9 and r.ours == 3
    assert r.ns_of is None
    assert r.report == {
        "records_skipped": 1,
        "blocks_dropped": 0,
        "blocks_recovered": 2,
        "blocks_over_capacity": 1,
        "blocks_of_other_namespaces": 1,
    }


def test_settle_keeps_the_newest_copy_of_a_key() -> None:
    # A lost FREE record can leave an older copy of a key in another slot.
    e = entries((0, 1, 5, A), (4, 1, 9, A))
    r = recovery.settle(e, ns=A, capacity=8, skipped=0, dropped=2, top_seq=9)
    assert np.flatnonzero(r.seqs).tolist() == [4]
    assert r.report["blocks_dropped"] == 3  # the two given plus the stale copy
    assert r.free.tolist() == [0, 1, 2, 3, 5, 6, 7]


def test_settle_for_every_namespace_maps_slots_to_namespaces() -> None:
    r = recovery.settle(
        entries((0, 1, 1, A), (1, 1, 2, B)), ns=None, capacity=2, skipped=0, dropped=0, top_seq=2
    )
    assert r.live == 2 and r.kept == {} and r.ns_of == {0: A, 1: B}


def image_of(e: Entries, journal: bytes, writer: int | None) -> bytes:
    return encode_image(journal, 10, writer, 8, e)


def test_from_image_replays_the_tail_over_the_image() -> None:
    base = pack_record(OP_BASE, 0, 10, NO_KEY)
    img = decode_image(image_of(entries((0, 1, 3, A), (1, 2, 4, A)), base, A))
    assert img is not None
    tail = (
        pack_record(OP_FREE, 0, 11, NO_KEY)  # slot 0 freed
        + pack_record(OP_PUT, 1, 12, key(7))  # slot 1 rewritten
        + pack_record(OP_PUT, 5, 13, key(8))  # a new slot
        + pack_record(OP_PUT, 9, 14, key(9))  # past the slab's end: dropped
        + b"torn"
    )
    journal = base + tail
    assert recovery.image_matches(img, journal)
    got = recovery.from_image(img, journal, cap=8)
    assert got is not None
    rows = set(
        zip(
            got.entries.slots.tolist(),
            got.entries.keys.tolist(),
            got.entries.seqs.tolist(),
            strict=True,
        )
    )
    assert rows == {(1, key(7), 12), (5, key(8), 13)}
    assert set(got.entries.ns.tolist()) == {A}  # tail PUTs are the writer's
    assert (got.damaged, got.dropped, got.top_seq) == (1, 1, 14)
    assert got.tail == len(tail) and not got.distinct


def test_an_image_without_writer_cannot_take_tail_puts() -> None:
    base = pack_record(OP_BASE, 0, 1, NO_KEY)
    img = decode_image(image_of(entries(), base, None))
    assert img is not None
    assert recovery.from_image(img, base + pack_record(OP_PUT, 0, 2, key(1)), cap=4) is None
    assert recovery.from_image(img, base + pack_record(OP_FREE, 0, 2, NO_KEY), cap=4) is not None


def test_an_image_does_not_match_a_changed_journal() -> None:
    journal = pack_record(OP_BASE, 0, 1, NO_KEY) + pack_record(OP_PUT, 0, 2, key(1))
    img = decode_image(image_of(entries((0, 1, 2, A)), journal, A))
    assert img is not None and recovery.image_matches(img, journal)
    assert not recovery.image_matches(img, journal[:REC_SIZE])  # shorter than it covers
    changed = bytearray(journal)
    changed[REC_SIZE + 9] ^= 1
    assert not recovery.image_matches(img, bytes(changed))


def test_header_ns_checks_key_seq_and_length() -> None:
    payload = bytes(64)
    header, _ = encode_block(key(1), payload, namespace=A, seq=7)
    assert recovery.header_ns(header, len(header), key(1), 7, 64) == A
    assert recovery.header_ns(header, len(header), key(1), 8, 64) is None  # another write
    assert recovery.header_ns(header, len(header), key(2), 7, 64) is None  # another key
    assert recovery.header_ns(header, len(header), key(1), 7, 128) is None  # another length
    assert recovery.header_ns(header, 10, key(1), 7, 64) is None  # a short read
    bad = bytearray(header)
    bad[20] ^= 1
    assert recovery.header_ns(bytes(bad), len(bad), key(1), 7, 64) is None


def replay_by_record(
    data: bytes, capacity: int, per_key: bool
) -> tuple[list[JournalEntry], JournalReport]:
    """The replay rule, record by record (the form it had before the split): the
    specification `replay_journal`'s array form is held to."""
    best: dict[int, tuple[int, int, bytes]] = {}
    damaged, top = int(len(data) % REC_SIZE != 0), 0
    for off in range(0, len(data) - REC_SIZE + 1, REC_SIZE):
        rec = parse_record(data, off)
        if rec is None:
            damaged += 1
            continue
        op, slot, seq, k = rec
        top = max(top, seq)
        if op != OP_BASE and (slot not in best or seq > best[slot][0]):
            best[slot] = (seq, op, k)
    newest: dict[bytes, tuple[int, int]] = {}
    live: list[JournalEntry] = []
    out_of_range = superseded = 0
    for slot, (seq, op, k) in best.items():
        if op != OP_PUT:
            continue
        if slot >= capacity:
            out_of_range += 1
        elif not per_key:
            live.append(JournalEntry(slot, k, seq))
        elif k not in newest or seq > newest[k][0]:
            superseded += k in newest
            newest[k] = (seq, slot)
        else:
            superseded += 1
    live += (JournalEntry(s, k, q) for k, (q, s) in newest.items())
    entries = sorted(live, key=lambda e: e.seq)
    return entries, JournalReport(len(data) // REC_SIZE, damaged, out_of_range, superseded, top)


@settings(max_examples=300, deadline=None)
@given(
    records=st.lists(
        st.tuples(
            st.sampled_from([OP_PUT, OP_FREE, OP_BASE, 0]),
            st.integers(0, 9),
            st.integers(0, 6),  # few seqs: many ties
            st.integers(0, 3),
            st.booleans(),
        ),
        max_size=40,
    ),
    torn=st.binary(max_size=REC_SIZE - 1),
    capacity=st.integers(0, 10),
    per_key=st.booleans(),
)
def test_replay_journal_is_the_record_by_record_rule(
    records, torn, capacity: int, per_key: bool
) -> None:
    # Same entries in the same order (ties included) and the same report.
    journal = bytearray()
    for op, slot, seq, kid, bad in records:
        rec = bytearray(pack_record(op, slot, seq, key(kid)))
        if bad:
            rec[3] ^= 0x10
        journal += rec
    data = bytes(journal) + torn
    assert replay_journal(data, capacity, per_key=per_key) == replay_by_record(
        data, capacity, per_key
    )
