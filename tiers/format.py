"""The on-disk block record shared by the persistent tiers: header, checksum, codecs.

Primitives:
- `encode_block(key, payload, *, namespace_id, seq, compression, level, element_size)`
  -> (header bytes, stored payload): compresses when it pays, checksums header and payload.
- `decode_header(buf) -> BlockHeader` (raises `BlockCorruptError` on anything malformed).
- `header_problem(header, key, ns, length) -> str | None`: whether a header belongs to this
  key, namespace and raw length (the one check every reader makes); `is_header_of` on bytes,
  and `header_check(ns, length)`, the same on bytes as a function of (buf, key) for probes;
  `header_of(buf, key, ns, length)`: decode and check, raising what is wrong.
- `decode_payload(header, stored, dst)`: verifies the checksum, decompresses into `dst`.
- `is_raw_block(buf, key, ns, raw_len, seq)`: one compare and the checksum, for a reader
  that knows every header field (NVMe: the index names each slot's seq).
- `namespace_id(namespace) -> int`: the 64-bit namespace tag stamped into each header.

Header, little-endian, `HEADER_SIZE` = 64 bytes:

    offset size field
    0      4    magic b"TCB\\x01"
    4      2    format version (FORMAT_VERSION)
    6      1    codec: 0 raw, 1 zstd, 2 zstd over a 2-byte-plane shuffle
    7      1    reserved (0)
    8      16   block key
    24     8    namespace id (xxh3_64 of the namespace, utf-8)
    32     4    raw length (block bytes)
    36     4    stored payload length
    40     8    write sequence (monotonic per store; orders recovery by recency)
    48     8    reserved (0)
    56     8    checksum: xxh3_64(header[0:56] + stored payload)

The checksum covers the header too: a flipped bit in the key or a length is caught, so a
block can never be served under the wrong key. Nothing here unpickles or evaluates anything.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from tiercache.errors import BlockCorruptError

MAGIC = b"TCB\x01"
FORMAT_VERSION = 1
HEADER_SIZE = 64
CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_SHUFFLE2 = 0, 1, 2
MIN_RATIO = 1.05  # store raw unless compression saves at least ~5%

_HEAD = struct.Struct("<4sHBB16sQIIQQ")  # the first 56 bytes
_SUM = struct.Struct("<Q")
_IDENT = struct.Struct("<QI")  # namespace id, raw length: header bytes 24..36
_MAGIC_VERSION = MAGIC + FORMAT_VERSION.to_bytes(2, "little")
_CODECS = (CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_SHUFFLE2)
_CHECKED = 40  # header_check reads the header up to the stored length
_BUFFERS = (bytes, memoryview)
assert _HEAD.size + _SUM.size == HEADER_SIZE


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A decoded, structurally valid header (the payload is not verified yet)."""

    codec: int
    key: bytes
    namespace_id: int
    raw_len: int
    stored_len: int
    seq: int
    checksum: int
    prefix: bytes  # header[0:56], hashed together with the payload


def namespace_id(namespace: str | bytes) -> int:
    """64-bit tag of a namespace, stamped into headers (for inspection and filtering)."""
    data = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    return xxhash.xxh3_64_intdigest(data)


def shuffle2(buf: memoryview | bytes) -> bytes:
    """Split 16-bit elements into a low-byte plane then a high-byte plane (sign+exponent of
    bf16/fp16 compress well; mantissa bytes do not)."""
    a = np.frombuffer(buf, dtype="<u2")
    out = np.empty(2 * a.size, dtype=np.uint8)
    out[: a.size] = a  # uint16 -> uint8 keeps the low byte
    out[a.size :] = a >> 8
    return out.tobytes()


def unshuffle2(planes: bytes, dst: np.ndarray) -> None:
    """Inverse of `shuffle2`, written into the uint8 array `dst`."""
    n = len(planes) // 2
    p = np.frombuffer(planes, dtype=np.uint8)
    out = dst.view("<u2")
    np.left_shift(p[n:], 8, out=out, dtype="<u2")
    np.bitwise_or(out, p[:n], out=out)


def encode_block(
    key: bytes,
    payload: memoryview | bytes,
    *,
    namespace: int,
    seq: int,
    compression: str = "none",
    level: int = 1,
    element_size: int = 2,
    compressor: zstandard.ZstdCompressor | None = None,
) -> tuple[bytes, bytes]:
    """Header and stored bytes for one block; compressed only when it saves >= 5%."""
    raw = memoryview(payload).cast("B")
    stored: bytes | memoryview = raw
    codec = CODEC_RAW
    if compression == "zstd":
        zc = compressor or zstandard.ZstdCompressor(level=level)
        shuffled = element_size == 2 and len(raw) % 2 == 0
        packed = zc.compress(shuffle2(raw) if shuffled else raw)
        if len(packed) * MIN_RATIO <= len(raw):
            stored = packed
            codec = CODEC_ZSTD_SHUFFLE2 if shuffled else CODEC_ZSTD
    prefix = _HEAD.pack(
        MAGIC, FORMAT_VERSION, codec, 0, key, namespace, len(raw), len(stored), seq, 0
    )
    return prefix + _SUM.pack(_checksum(prefix, stored)), bytes(stored) if codec else stored  # type: ignore[return-value]


def decode_header(buf: bytes | memoryview) -> BlockHeader:
    """Parse a header; `BlockCorruptError` if it is short, foreign, of another version or
    inconsistent. Never trusts a length beyond what the caller can bound."""
    if len(buf) < HEADER_SIZE:
        raise BlockCorruptError(f"short header ({len(buf)} of {HEADER_SIZE} bytes)")
    prefix = bytes(buf[: _HEAD.size])
    magic, version, codec, _r, key, ns, raw_len, stored_len, seq, _r2 = _HEAD.unpack(prefix)
    if magic != MAGIC:
        raise BlockCorruptError("bad magic: not a tiercache block")
    if version != FORMAT_VERSION:
        raise BlockCorruptError(
            f"block format version {version}, this build reads {FORMAT_VERSION}"
        )
    if codec not in (CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_SHUFFLE2):
        raise BlockCorruptError(f"unknown codec {codec}")
    if codec == CODEC_RAW and stored_len != raw_len:
        raise BlockCorruptError("raw block with stored length != raw length")
    if codec == CODEC_ZSTD_SHUFFLE2 and raw_len % 2:  # never written: unshuffle2 needs pairs
        raise BlockCorruptError("byte-plane shuffled block of odd length")
    (checksum,) = _SUM.unpack(bytes(buf[_HEAD.size : HEADER_SIZE]))
    return BlockHeader(codec, key, ns, raw_len, stored_len, seq, checksum, prefix)


def header_problem(
    header: BlockHeader, key: bytes, ns: int | None, length: int | None
) -> str | None:
    """What makes `header` not the header of block `key` in namespace `ns` holding `length`
    raw bytes, or None: the one check every reader makes (`ns` or `length` None: not
    checked). The payload's length and checksum are checked when it is read."""
    if header.key != key:
        return f"header holds key {header.key.hex()}"
    if ns is not None and header.namespace_id != ns:
        return f"a block of namespace id:{header.namespace_id:016x} under id:{ns:016x}"
    if length is not None and header.raw_len != length:
        return f"header says {header.raw_len} bytes, the store's blocks are {length}"
    return None


def header_of(
    buf: bytes | memoryview, key: bytes, ns: int | None, length: int | None
) -> BlockHeader:
    """`decode_header`, then `header_problem` raised: the header of block `key` in `ns` of
    `length` raw bytes, or `BlockCorruptError` saying what it is instead."""
    h = decode_header(buf)
    problem = header_problem(h, key, ns, length)
    if problem is not None:
        raise BlockCorruptError(problem)
    return h


@functools.lru_cache(maxsize=64)  # a tier asks for the same one at every probe
def header_check(namespace: int, raw_len: int) -> Callable[[object, bytes], bool]:
    """`is_header_of` for one namespace and raw length, as a function of (buf, key) that
    compares bytes in place (no `BlockHeader` built): a lookup's probe runs it once per key.
    It accepts exactly the headers `decode_header` + `header_problem` accept."""
    tail = _IDENT.pack(namespace, raw_len)  # namespace id and raw length, as stored
    raw_stored = tail[8:]  # a raw block's stored length equals its raw length
    codecs = (CODEC_RAW, CODEC_ZSTD) if raw_len % 2 else _CODECS  # shuffle2 needs pairs
    starts = frozenset(_MAGIC_VERSION + bytes((c,)) for c in codecs)  # magic, version, codec

    def check(buf: object, key: bytes) -> bool:
        if type(buf) is not bytes:  # a probe's LMDB read hands out bytes: tested first
            if not isinstance(buf, _BUFFERS) or len(buf) < HEADER_SIZE:
                return False
            buf = bytes(buf[:_CHECKED])
        elif len(buf) < HEADER_SIZE:
            return False
        return (
            buf[:7] in starts
            and buf[8:36] == key + tail
            and (buf[6] != CODEC_RAW or buf[36:40] == raw_stored)
        )

    return check


def is_header_of(buf: object, key: bytes, namespace: int, raw_len: int) -> bool:
    """Whether `buf` starts with a well-formed header of block `key` in `namespace` holding
    `raw_len` bytes (a probe's check; the payload is verified when it is read)."""
    return header_check(namespace, raw_len)(buf, key)


def verify(header: BlockHeader, stored: bytes | memoryview) -> None:
    """Check the checksum over header and stored payload; `BlockCorruptError` on mismatch."""
    if len(stored) != header.stored_len:
        raise BlockCorruptError(f"short payload ({len(stored)} of {header.stored_len} bytes)")
    if _checksum(header.prefix, stored) != header.checksum:
        raise BlockCorruptError("checksum mismatch")


def _checksum(prefix: bytes, stored: object) -> int:
    """The checksum a header carries: xxh3_64 over its first 56 bytes, then the payload."""
    h = xxhash.xxh3_64(prefix)
    h.update(stored)  # type: ignore[arg-type]
    return h.intdigest()


def is_raw_block(buf: memoryview, key: bytes, namespace: int, raw_len: int, seq: int) -> bool:
    """Whether `buf` (a header, then at least `raw_len` payload bytes) holds exactly the raw
    block `key` of `namespace`, `raw_len` bytes, written as `seq`, checksum verified: one
    compare and the checksum, for a reader that knows the seq (NVMe). False says nothing
    more: the caller decodes the header to learn what is wrong."""
    prefix = _HEAD.pack(
        MAGIC, FORMAT_VERSION, CODEC_RAW, 0, key, namespace, raw_len, raw_len, seq, 0
    )
    if buf[: _HEAD.size] != prefix:
        return False
    payload = buf[HEADER_SIZE : HEADER_SIZE + raw_len]
    return _checksum(prefix, payload) == int.from_bytes(buf[_HEAD.size : HEADER_SIZE], "little")


def decode_payload(
    header: BlockHeader,
    stored: bytes | memoryview,
    dst: np.ndarray,
    decompressor: zstandard.ZstdDecompressor | None = None,
) -> None:
    """Verify, then write the block's raw bytes into the uint8 array `dst` (len raw_len)."""
    if dst.size != header.raw_len:
        raise BlockCorruptError(f"block holds {header.raw_len} bytes, expected {dst.size}")
    verify(header, stored)
    if header.codec == CODEC_RAW:
        dst[:] = np.frombuffer(stored, dtype=np.uint8)
        return
    dz = decompressor or zstandard.ZstdDecompressor()
    try:
        raw = dz.decompress(stored, max_output_size=header.raw_len)
    except zstandard.ZstdError as exc:
        raise BlockCorruptError(f"zstd: {exc}") from None
    if len(raw) != header.raw_len:
        raise BlockCorruptError("decompressed length mismatch")
    if header.codec == CODEC_ZSTD_SHUFFLE2:
        unshuffle2(raw, dst)
    else:
        dst[:] = np.frombuffer(raw, dtype=np.uint8)
