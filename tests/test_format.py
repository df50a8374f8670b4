"""The persistent block record: round trips, codecs, and corruption always detected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.errors import BlockCorruptError
from tiercache.tiers import format as fmt

KEY = bytes(range(16))


def bf16_block(n: int = 4096, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "compression,codec", [("none", fmt.CODEC_RAW), ("zstd", fmt.CODEC_ZSTD_SHUFFLE2)]
)
def test_round_trip(compression, codec) -> None:
    raw = bf16_block()
    head, stored = fmt.encode_block(
        KEY, raw, namespace=fmt.namespace_id("ns"), seq=7, compression=compression
    )
    h = fmt.decode_header(head)
    assert (h.codec, h.key, h.raw_len, h.seq) == (codec, KEY, len(raw), 7)
    assert h.namespace_id == fmt.namespace_id("ns")
    dst = np.empty(len(raw), dtype=np.uint8)
    fmt.decode_payload(h, stored, dst)
    assert dst.tobytes() == raw
    if compression == "zstd":
        assert len(stored) < len(raw) / 1.2  # shuffled randn bf16: ~1.28x at 8 KiB


def test_incompressible_is_stored_raw() -> None:
    raw = np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8).tobytes()
    head, stored = fmt.encode_block(KEY, raw, namespace=1, seq=1, compression="zstd")
    assert fmt.decode_header(head).codec == fmt.CODEC_RAW and bytes(stored) == raw


def test_shuffle_round_trip() -> None:
    raw = bf16_block(1000, 3)
    dst = np.empty(len(raw), dtype=np.uint8)
    fmt.unshuffle2(fmt.shuffle2(raw), dst)
    assert dst.tobytes() == raw


def test_foreign_and_future_headers_refused() -> None:
    head, _ = fmt.encode_block(KEY, b"x" * 64, namespace=1, seq=1)
    with pytest.raises(BlockCorruptError, match="magic"):
        fmt.decode_header(b"PK\x03\x04" + head[4:])
    future = bytearray(head)
    future[4:6] = (fmt.FORMAT_VERSION + 1).to_bytes(2, "little")
    with pytest.raises(BlockCorruptError, match="version"):
        fmt.decode_header(bytes(future))
    with pytest.raises(BlockCorruptError, match="short header"):
        fmt.decode_header(head[:20])


@settings(max_examples=300, deadline=None)
@given(
    pos=st.integers(0, fmt.HEADER_SIZE + 255),
    bit=st.integers(0, 7),
    compression=st.sampled_from(["none", "zstd"]),
)
def test_any_flipped_bit_is_detected(pos: int, bit: int, compression: str) -> None:
    """A single flipped bit anywhere in header or payload never yields bytes."""
    raw = bf16_block(128, 1)
    head, stored = fmt.encode_block(KEY, raw, namespace=5, seq=9, compression=compression)
    record = bytearray(head + bytes(stored))
    pos %= len(record)
    record[pos] ^= 1 << bit
    with pytest.raises(BlockCorruptError):
        h = fmt.decode_header(record)
        dst = np.empty(len(raw), dtype=np.uint8)
        fmt.decode_payload(h, bytes(record[fmt.HEADER_SIZE : fmt.HEADER_SIZE + h.stored_len]), dst)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_header_parser_fuzz(data: bytes) -> None:
    """Arbitrary bytes either parse into a bounded header or raise BlockCorruptError."""
    try:
        h = fmt.decode_header(data)
    except BlockCorruptError:
        return
    assert len(h.key) == 16 and h.codec in (0, 1, 2)


def test_wrong_destination_size() -> None:
    head, stored = fmt.encode_block(KEY, b"y" * 64, namespace=1, seq=1)
    with pytest.raises(BlockCorruptError, match="expected 32"):
        fmt.decode_payload(fmt.decode_header(head), stored, np.empty(32, dtype=np.uint8))


def test_is_raw_block_accepts_exactly_what_decoding_accepts() -> None:
    """`is_raw_block` (NVMe's read path, knowing the seq from its index) says yes only where
    decode_header + header_problem + verify would, for that key, namespace, length and seq."""
    key, ns, seq = bytes(range(16)), fmt.namespace_id("m"), 77
    payload = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    header, stored = fmt.encode_block(key, payload, namespace=ns, seq=seq)
    slot = bytearray(header + bytes(stored) + b"\0" * 100)  # a slot: header, payload, slack
    view = memoryview(slot)
    assert fmt.is_raw_block(view, key, ns, 4096, seq)
    h = fmt.decode_header(view)
    assert fmt.header_problem(h, key, ns, 4096) is None
    fmt.verify(h, view[fmt.HEADER_SIZE : fmt.HEADER_SIZE + 4096])
    assert not fmt.is_raw_block(view, key, ns, 4096, seq + 1)  # another write of the key
    assert not fmt.is_raw_block(view, bytes(16), ns, 4096, seq)
    assert not fmt.is_raw_block(view, key, ns + 1, 4096, seq)
    assert not fmt.is_raw_block(view, key, ns, 4095, seq)
    for at in (0, 8, 30, 60, fmt.HEADER_SIZE, fmt.HEADER_SIZE + 4095):
        bad = bytearray(slot)
        bad[at] ^= 0x01
        assert not fmt.is_raw_block(memoryview(bad), key, ns, 4096, seq), at
    zeros = bytes(4096)  # compresses: another codec, never "raw"
    header, stored = fmt.encode_block(key, zeros, namespace=ns, seq=seq, compression="zstd")
    assert not fmt.is_raw_block(memoryview(header + bytes(stored) + zeros), key, ns, 4096, seq)
