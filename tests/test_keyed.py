"""The rules LMDB and Redis share (tiers/keyed.py) and format.header_problem: ownership of
slots by key, pending deletes, one stored value decoded, codec checks, write counters."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import zstandard

from tiercache.errors import ConfigError
from tiercache.tiers import format as fmt
from tiercache.tiers.keyed import (
    COMPRESSIONS,
    ZSTD_MIN_LEVEL,
    KeyedTier,
    PendingDeletes,
    add_written,
    check_codec,
    compression_ratio,
    leading_clear,
)

BB = 64
NS = fmt.namespace_id("ns")


def key(i: int) -> bytes:
    return bytes([i]) * 16


class _Store(KeyedTier):
    """A KeyedTier with nothing behind it: only the shared rules are exercised."""

    kind: ClassVar[str] = "test-keyed"
    store_label: ClassVar[str] = "Test"

    def __init__(self, compression: str = "none") -> None:
        super().__init__(
            name="t", block_bytes=BB, capacity_blocks=4, compression=compression, level=3
        )
        self._ns = NS
        self._element_size = 2

    def write(self, slots: Any, src: Any, keys: Any = None) -> None:  # pragma: no cover
        raise NotImplementedError

    def read(self, slots: Any, dst: Any, keys: Any = None) -> list[int]:  # pragma: no cover
        raise NotImplementedError

    @classmethod
    def from_config(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> _Store:
        raise NotImplementedError  # pragma: no cover


# -- format.header_problem -------------------------------------------------------------------
def _head(k: bytes = key(1), ns: int = NS, raw: bytes = b"x" * BB) -> fmt.BlockHeader:
    return fmt.decode_header(fmt.encode_block(k, raw, namespace=ns, seq=1)[0])


def test_header_problem_accepts_its_own_block() -> None:
    assert fmt.header_problem(_head(), key(1), NS, BB) is None
    # None: the field is not checked.
    assert fmt.header_problem(_head(ns=NS + 1), key(1), None, BB) is None
    assert fmt.header_problem(_head(raw=b"x" * 8), key(1), NS, None) is None


def test_header_problem_names_each_mismatch() -> None:
    assert fmt.header_problem(_head(), key(2), NS, BB) == f"header holds key {key(1).hex()}"
    assert fmt.header_problem(_head(ns=5), key(1), 6, BB) == (
        f"a block of namespace id:{5:016x} under id:{6:016x}"
    )
    assert fmt.header_problem(_head(raw=b"x" * 8), key(1), NS, BB) == (
        f"header says 8 bytes, the store's blocks are {BB}"
    )
    # The key is checked first, then the namespace, then the length.
    assert fmt.header_problem(_head(ns=5, raw=b"x" * 8), key(2), 6, BB).startswith("header holds")
    assert "namespace" in fmt.header_problem(_head(ns=5, raw=b"x" * 8), key(1), 6, BB)


def test_is_header_of_agrees_with_header_problem() -> None:
    head, _ = fmt.encode_block(key(1), b"x" * BB, namespace=NS, seq=1)
    assert fmt.is_header_of(head, key(1), NS, BB)
    assert not fmt.is_header_of(head, key(2), NS, BB)
    assert not fmt.is_header_of(head, key(1), NS + 1, BB)
    assert not fmt.is_header_of(head, key(1), NS, BB + 1)
    assert not fmt.is_header_of(head[:10], key(1), NS, BB)
    assert not fmt.is_header_of(None, key(1), NS, BB)


def _decoded_check(buf: object, k: bytes, ns: int, raw_len: int) -> bool:
    """The reference `header_check` must agree with: decode the header, then header_problem."""
    if not isinstance(buf, bytes | memoryview) or len(buf) < fmt.HEADER_SIZE:
        return False
    try:
        h = fmt.decode_header(buf)
    except fmt.BlockCorruptError:
        return False
    return fmt.header_problem(h, k, ns, raw_len) is None


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("raw_len", [BB, BB + 1])
def test_header_check_accepts_exactly_what_decoding_accepts(compression: str, raw_len: int) -> None:
    # Every single-byte change of a real header (each byte set to several values, the
    # codec byte to every one), plus lengths, keys, namespaces and a memoryview (as LMDB
    # hands them out): the byte compares answer as decode_header + header_problem do.
    rows = {
        "raw": fmt.encode_block(key(1), b"x" * raw_len, namespace=NS, seq=3)[0],
        "packed": fmt.encode_block(
            key(1), bytes(raw_len), namespace=NS, seq=3, compression=compression
        )[0],
    }
    check = fmt.header_check(NS, raw_len)
    seen = {True: 0, False: 0}
    for head in rows.values():
        variants = [head, head + b"\0" * 8, head[:-1], b"", head[:40]]
        for at in range(fmt.HEADER_SIZE):
            for v in {0, 1, 2, 3, 255, head[at] ^ 1, (head[at] + 2) % 256}:
                variants.append(head[:at] + bytes([v]) + head[at + 1 :])
        for buf in variants:
            for k, ns, n in ((key(1), NS, raw_len), (key(2), NS, raw_len), (key(1), NS + 1, 64)):
                want = _decoded_check(buf, k, ns, n)
                assert fmt.header_check(ns, n)(buf, k) is want, (buf.hex(), k, ns, n)
                assert fmt.is_header_of(memoryview(buf), k, ns, n) is want
                seen[want] += 1
        assert check(head, key(1)) and not check(None, key(1))
    assert seen[True] > 10 and seen[False] > 100  # both answers were exercised


# -- ownership and pending deletes ------------------------------------------------------------
def test_release_answers_only_blocks_this_instance_stored() -> None:
    t = _Store()
    t._take_found([key(9)])  # found at open: slot 0, not ours
    slots = t.allocate([key(1), key(2)])
    assert slots == [1, 2]
    assert t._claim(slots, [key(1), key(2)]) == []
    assert sorted(t._release([0, 1])) == [key(1)]  # the found block is only forgotten
    assert 0 not in t._slot_key and 1 not in t._slot_key and 1 not in t._own
    adopted = t.adopt([key(3)])
    assert adopted is not None
    t._slot_key[adopted[0]] = key(3)
    assert t._release(adopted) == []  # adopted: only forgotten
    assert t._release([2]) == [key(2)]
    assert t._release([2]) == []  # twice: nothing more


def test_claim_answers_the_key_of_ours_a_slot_held_before() -> None:
    t = _Store()
    t._take_found([key(9)])
    assert t._claim([1], [key(1)]) == []
    assert t._claim([1], [key(1)]) == []  # the same key again: nothing replaced
    assert t._claim([1], [key(2)]) == [key(1)]
    assert t._slot_key[1] == key(2) and 1 in t._own
    # A found block's slot written under another key: the old key is not ours to delete.
    assert t._claim([0], [key(3)]) == []
    assert 0 in t._own


def test_pending_deletes_rules() -> None:
    p = PendingDeletes()
    assert not p and len(p) == 0
    p.add([key(1), key(2)])
    p.add([b"bad"], 7)
    assert key(1) in p and len(p) == 3
    p.unpend([key(2), key(5)])  # stored again (or never pending): live
    assert key(2) not in p
    taken = p.take()
    assert taken == {key(1): None, b"bad": 7} and not p
    p.add([key(4)])
    p.restore(taken, stored=[key(1)])  # the send failed; key(1) was stored meanwhile
    assert p.entries == {key(4): None, b"bad": 7}
    # Stored again while its delete was out (another thread's write): a failed send must
    # not make the delete of a live key pending again.
    taken = p.take()
    p.unpend([key(4)])
    p.restore(taken)
    assert p.entries == {b"bad": 7}
    # Sent: forgotten, a late restore puts nothing back.
    p.add([key(6)])
    taken = p.take()
    assert set(taken) == {key(6), b"bad"}
    p.sent(taken)
    p.restore(taken)
    assert not p and p.snapshot() == set()


def test_probe_stops_at_a_pending_key() -> None:
    keys = [key(1), key(2), key(3)]
    assert leading_clear(keys, set()) == 3
    assert leading_clear(keys, {key(2)}) == 1
    assert leading_clear(keys, {key(1)}) == 0
    assert leading_clear(keys, {b"ns" + key(3)}, prefix=b"ns") == 2
    assert leading_clear(keys, {key(3)}, prefix=b"ns") == 3


# -- one stored value ---------------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_decode_block_serves_only_a_good_block_of_its_key(compression: str) -> None:
    t = _Store(compression)
    raw = bytes(BB)  # compresses: the zstd path
    head, body = fmt.encode_block(
        key(1), raw, namespace=NS, seq=1, compression=compression, compressor=t._compressor()
    )
    row = np.full(BB, 7, dtype=np.uint8)
    assert t._decode_block(key(1), head, body, row)
    assert row.tobytes() == raw
    assert not t._decode_block(key(2), head, body, row)  # another key
    assert not t._decode_block(key(1), head, bytes(body)[:-1], row)  # short payload
    bad = bytearray(body)
    bad[0] ^= 1
    assert not t._decode_block(key(1), head, bytes(bad), row)  # checksum
    other, obody = fmt.encode_block(key(1), raw, namespace=NS + 1, seq=1)
    assert not t._decode_block(key(1), other, obody, row)  # another namespace
    short, sbody = fmt.encode_block(key(1), raw[:8], namespace=NS, seq=1)
    assert not t._decode_block(key(1), short, sbody, row)  # another block size
    assert not t._decode_block(key(1), b"junk", body, row)


def test_header_raises_with_the_problem() -> None:
    t = _Store()
    head, body = fmt.encode_block(key(1), bytes(BB), namespace=NS, seq=4)
    assert t._header(key(1), head, len(body)).seq == 4
    with pytest.raises(fmt.BlockCorruptError, match="header holds key"):
        t._header(key(2), head, len(body))
    with pytest.raises(fmt.BlockCorruptError, match="length mismatch"):
        t._header(key(1), head, len(body) + 1)


# -- codec checks and counters -----------------------------------------------------------------
def test_check_codec() -> None:
    assert COMPRESSIONS == ("none", "zstd")
    check_codec("zstd", ZSTD_MIN_LEVEL, 1)
    check_codec("none", zstandard.MAX_COMPRESSION_LEVEL, 2)
    with pytest.raises(ConfigError, match=r"x\.compression"):
        check_codec("lz4", 1, 2, "x")
    for level in (ZSTD_MIN_LEVEL - 1, zstandard.MAX_COMPRESSION_LEVEL + 1, True, 1.0):
        with pytest.raises(ConfigError, match="level"):
            check_codec("zstd", level, 2)
    for es in (0, 3, True):
        with pytest.raises(ConfigError, match="element_size"):
            check_codec("zstd", 1, es)


def test_compression_ratio() -> None:
    counts = dict.fromkeys(("blocks_written", "raw_bytes", "stored_bytes"), 0)
    assert compression_ratio(counts) == 1.0
    add_written(counts, 2, 200, 50)
    add_written(counts, 1, 100, 100)
    assert counts == {"blocks_written": 3, "raw_bytes": 300, "stored_bytes": 150}
    assert compression_ratio(counts) == 2.0


# -- the checks every read and write starts with, one block encoded --------------------------------
def test_io_keys_checks_blocks_keys_and_open() -> None:
    t = _Store()
    blocks = torch.zeros(2, BB, dtype=torch.uint8)
    assert t._io_keys([0, 1], blocks, [key(1), key(2)], "src") == [key(1), key(2)]
    with pytest.raises(ValueError, match="pass one key per slot"):
        t._io_keys([0, 1], blocks, None, "src")
    with pytest.raises(ValueError, match="expected 2 keys"):
        t._io_keys([0, 1], blocks, [key(1)], "src")
    with pytest.raises(ValueError, match="src"):
        t._io_keys([0], blocks, [key(1)], "src")
    t.close()
    with pytest.raises(RuntimeError, match="the Test tier is closed"):
        t._io_keys([0, 1], blocks, [key(1), key(2)], "src")


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_encode_round_trips_through_decode_block(compression: str) -> None:
    t = _Store(compression)
    raw = np.zeros(BB, dtype=np.uint8)
    head, body = t._encode(key(3), raw, 9, t._compressor())
    h = fmt.decode_header(head)
    assert (h.key, h.namespace_id, h.seq) == (key(3), NS, 9)
    assert (h.codec != fmt.CODEC_RAW) == (compression == "zstd")
    row = np.ones(BB, dtype=np.uint8)
    assert t._decode_block(key(3), head, body, row) and not row.any()
