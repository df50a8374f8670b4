"""Prefix hashing: one chained 16-byte key per full block of token ids.

Primitives
----------
- ``prefix_hashes(token_ids, block_size, *, namespace, extra_keys=None) -> list[bytes]``
- ``root_hash(namespace) -> bytes``: the parent of block 0 (``key[-1]``).
- ``group_keys(keys, group) -> list[bytes]``: the keys of one KV cache group of a model
  with several (vLLM's hybrid KV cache manager); group ``""`` leaves the keys as they are.
- ``shard_keys(keys, shards) -> list[bytes]``: the keys of head shards ``shards`` of each
  block (the TP-independent layout, `tiercache.transfer.head_shards`), block-major.
- ``make_namespace(*, model, dtype, block_size, layout, tp_size, tp_rank, extra) -> str``
- ``FORMAT_VERSION``: the version of the byte format below; bump it on any change.

Byte format, version 1 (the full specification, ``enc`` included: ``docs/hashing.md``),
``H(x)`` being XXH3-128 with seed 0 as its 16-byte canonical big-endian digest::

    key[-1] = H(b"tiercache/prefix/v1\\x00" + N)
    key[i]  = H(key[i-1] + T[i] + X[i])            for each full block i = 0, 1, ...
    gkey[i] = H(b"tiercache/group/v1\\x00" + u64(len(G)) + G + key[i])     (G non-empty)
    skey    = H(b"tiercache/shard/v1\\x00" + u16(j) + k)    shard j of the block with key k

``N`` is the namespace (``str`` as strict UTF-8, or ``bytes``; non-empty), ``T[i]`` the
block's tokens as little-endian uint32, ``X[i]`` its extra (``b""`` or a tagged,
length-prefixed ``enc(tuple(values))``), ``G`` a KV cache group's UTF-8 name. For a fixed
``block_size`` every message splits uniquely; ``block_size`` itself is not hashed, so it
must be part of the namespace (``make_namespace`` puts it there). ``extra_keys`` is a
sequence of request-level values (the extra of block 0) or a mapping ``{block_index:
sequence}`` for per-block inputs. Python's ``hash()`` is never used, so keys are equal
across processes, machines and ``PYTHONHASHSEED`` values.
"""

from __future__ import annotations

import array
import json
import math
import operator
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from xxhash import xxh3_128_digest

__all__ = [
    "FORMAT_VERSION",
    "KEY_SIZE",
    "group_keys",
    "make_namespace",
    "prefix_hashes",
    "root_hash",
    "shard_keys",
]

FORMAT_VERSION = 1
KEY_SIZE = 16
_ROOT_PREFIX = f"tiercache/prefix/v{FORMAT_VERSION}\x00".encode()
_NAMESPACE_PREFIX = f"tiercache-ns/v{FORMAT_VERSION}:"
_GROUP_PREFIX = b"tiercache/group/v1\x00"
_SHARD_PREFIX = b"tiercache/shard/v1\x00"
_TOKEN_LIMIT = 2**32
_U64 = struct.Struct("<Q").pack
_F64 = struct.Struct("<d").pack
# array.array typecode whose items are 4-byte unsigned ints on this platform.
_U32_CODE = next(c for c in "IL" if array.array(c).itemsize == 4)


def root_hash(namespace: str | bytes) -> bytes:
    """Return ``key[-1]``, the parent of block 0, for ``namespace``."""
    return xxh3_128_digest(_ROOT_PREFIX + _namespace_bytes(namespace))


def make_namespace(
    *,
    model: str,
    dtype: str,
    block_size: int,
    layout: str = "",
    tp_size: int | None = 1,
    tp_rank: int = 0,
    extra: str = "",
) -> str:
    """Build the canonical namespace string for KV blocks that are byte-compatible.

    The result is ``"tiercache-ns/v1:"`` followed by compact JSON with sorted keys,
    e.g. ``tiercache-ns/v1:{"block_size":16,"dtype":"bfloat16","extra":"",
    "layout":"","model":"m","tp_rank":0,"tp_size":1}``. It is hashed verbatim, so
    its layout is part of the v1 byte format. ``tp_size=None`` leaves both TP fields out:
    blocks whose bytes do not depend on the tensor-parallel layout (head shards).
    """
    fields: dict[str, Any] = {
        "model": _check_str("model", model, nonempty=True),
        "dtype": _check_str("dtype", dtype, nonempty=True),
        "layout": _check_str("layout", layout),
        "extra": _check_str("extra", extra),
        "block_size": _check_int("block_size", block_size, 1),
    }
    if tp_size is not None:
        fields["tp_size"] = _check_int("tp_size", tp_size, 1)
        fields["tp_rank"] = _check_int("tp_rank", tp_rank, 0)
        if fields["tp_rank"] >= fields["tp_size"]:
            raise ValueError(f"tp_rank must be < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return _NAMESPACE_PREFIX + body


def prefix_hashes(
    token_ids: Any,
    block_size: int,
    *,
    namespace: str | bytes,
    extra_keys: Sequence[Any] | Mapping[int, Sequence[Any]] | None = None,
) -> list[bytes]:
    """Return one chained 16-byte key per full block of ``token_ids``.

    ``token_ids`` is a sequence of ints, a 1-D integer numpy array or a 1-D integer
    torch tensor (moved to CPU if needed), with every id in ``[0, 2**32)``.
    ``extra_keys`` is a sequence of request-level values (the extra of block 0) or a
    mapping ``{block_index: sequence}``; see the module docstring for the bytes.
    Bad ids, ``block_size``, ``namespace`` or ``extra_keys`` raise ValueError or
    TypeError naming the argument. (A ``bool`` inside a Python list counts as an int;
    bool arrays and tensors are rejected.)
    """
    block_size = _check_int("block_size", block_size, 1)
    parent = root_hash(namespace)
    extras = _normalise_extra_keys(extra_keys)
    buf = _token_bytes(token_ids)
    step = 4 * block_size
    n_blocks = len(buf) // step
    out: list[bytes] = []
    if n_blocks == 0:
        return out
    if not extras:
        _chain(buf[: n_blocks * step], step, parent, out)
        return out
    # Only the blocks that carry an extra leave the fast path.
    start = 0
    for j in sorted(i for i in extras if i < n_blocks):
        parent = _chain(buf[start * step : j * step], step, parent, out)
        parent = xxh3_128_digest(parent + buf[j * step : (j + 1) * step] + extras[j])
        out.append(parent)
        start = j + 1
    _chain(buf[start * step : n_blocks * step], step, parent, out)
    return out


def group_keys(keys: Sequence[bytes], group: str) -> list[bytes]:
    """The keys of KV cache group `group` for the prefix `keys` (see the module docstring);
    ``""`` returns them unchanged."""
    if not isinstance(group, str):
        raise TypeError(f"group: expected a str, got {type(group).__name__}")
    if not group:
        return list(keys)
    name = group.encode("utf-8")
    head = _GROUP_PREFIX + _U64(len(name)) + name
    digest = xxh3_128_digest
    return [digest(head + k) for k in keys]


def shard_keys(keys: Sequence[bytes], shards: Sequence[int] | range) -> list[bytes]:
    """The keys of head shards `shards` of each block of `keys` (see the module docstring),
    block-major: ``[skey(keys[0], shards[0]), skey(keys[0], shards[1]), ...]``."""
    heads = []
    for j in shards:
        if isinstance(j, bool) or not isinstance(j, int) or not 0 <= j < 1 << 16:
            raise ValueError(f"shards: expected ints in [0, 65536), got {j!r}")
        heads.append(_SHARD_PREFIX + j.to_bytes(2, "little"))
    for k in keys:
        if not isinstance(k, bytes):
            raise TypeError(f"keys: expected bytes block keys, got {type(k).__name__}")
    digest = xxh3_128_digest
    return [digest(h + k) for k in keys for h in heads]


def _chain(buf: memoryview, step: int, parent: bytes, out: list[bytes]) -> bytes:
    # struct.iter_unpack slices the blocks in C, no Python slice per block (figures:
    # bench/bench_hashing.py --variants, docs/bench.md).
    digest = xxh3_128_digest
    append = out.append
    for (block,) in struct.iter_unpack(f"{step}s", buf):
        parent = digest(parent + block)
        append(parent)
    return parent


# --- validation and encoding -------------------------------------------------


def _namespace_bytes(namespace: str | bytes) -> bytes:
    if isinstance(namespace, str):
        try:
            data = namespace.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"namespace is not encodable as UTF-8: {exc}") from None
    elif isinstance(namespace, bytes):
        data = namespace
    else:
        raise TypeError(f"namespace must be str or bytes, got {type(namespace).__name__}")
    if not data:
        raise ValueError("namespace must be non-empty")
    return data


def _check_int(name: str, value: Any, minimum: int) -> int:
    # Integer parameters raise ValueError for both a wrong type and a too-small
    # value, as the hashing contract specifies for block_size.
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def _check_str(name: str, value: Any, *, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, got {type(value).__name__}")
    if nonempty and not value:
        raise ValueError(f"{name} must be non-empty")
    return value


def _token_bytes(token_ids: Any) -> memoryview:
    """Validate ``token_ids`` and return its ids as little-endian uint32 bytes."""
    torch = sys.modules.get("torch")  # a tensor implies torch is already imported
    if torch is not None and isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex:
            raise TypeError(f"token_ids must have an integer dtype, got {token_ids.dtype}")
        if token_ids.dtype == torch.bool:
            raise TypeError("token_ids must have an integer dtype, got torch.bool")
        token_ids = token_ids.numpy(force=True)  # detach, move to CPU, resolve views
    if isinstance(token_ids, np.ndarray):
        return _array_bytes(token_ids)
    if isinstance(token_ids, str | bytes | bytearray | memoryview) or not isinstance(
        token_ids, Sequence
    ):
        raise TypeError(
            "token_ids must be a sequence of ints, a numpy array or a torch tensor, "
            f"got {type(token_ids).__name__}"
        )
    try:
        ids = array.array(_U32_CODE, token_ids)  # one C-level pass, range-checked
    except (OverflowError, TypeError):
        raise _bad_token_error(token_ids) from None
    if sys.byteorder != "little":
        ids.byteswap()
    return memoryview(ids).cast("B")


def _array_bytes(arr: np.ndarray) -> memoryview:
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token_ids must have an integer dtype, got {arr.dtype}")
    bits = 8 * arr.dtype.itemsize
    limit = min(_TOKEN_LIMIT, 2 ** (bits - 1)) if arr.dtype.kind == "i" else _TOKEN_LIMIT
    if arr.size and limit < 2**bits:
        # One reduction instead of min() and max(): viewed as unsigned (same byte
        # order), negative signed ids wrap to >= 2**(bits-1) and so exceed limit.
        unsigned = arr.view(arr.dtype.str.replace("i", "u"))
        if unsigned.max() >= limit:
            i = int(np.flatnonzero((arr < 0) | (arr >= _TOKEN_LIMIT))[0])
            raise ValueError(f"token_ids[{i}] = {arr[i]} is outside [0, 2**32)")
    u32 = np.ascontiguousarray(arr, dtype="<u4")
    return memoryview(u32.view(np.uint8))


def _bad_token_error(token_ids: Sequence[Any]) -> Exception:
    # Error path only: find the first offending id to name it in the message.
    for i, t in enumerate(token_ids):
        try:
            v = operator.index(t)
        except TypeError:
            return TypeError(f"token_ids[{i}] must be an int, got {type(t).__name__} {t!r}")
        if not 0 <= v < _TOKEN_LIMIT:
            return ValueError(f"token_ids[{i}] = {v} is outside [0, 2**32)")
    return TypeError("token_ids could not be converted to uint32")


def _normalise_extra_keys(extra_keys: Any) -> dict[int, bytes]:
    """Map block index -> encoded extra ``X[i]``; empty extras are dropped."""
    if extra_keys is None:
        return {}
    if isinstance(extra_keys, Mapping):
        items = []
        for index, values in extra_keys.items():
            i = _check_int("extra_keys index", index, 0)
            items.append((i, _as_values(f"extra_keys[{i}]", values)))
    else:
        items = [(0, _as_values("extra_keys", extra_keys))]
    return {i: _encode_value(v, "extra_keys") for i, v in items if v}


def _as_values(name: str, values: Any) -> tuple[Any, ...]:
    if isinstance(values, str | bytes | bytearray) or not isinstance(values, Sequence):
        raise TypeError(
            f"{name} must be a sequence (tuple or list) of values, got {type(values).__name__}"
        )
    return tuple(values)


def _encode_value(v: Any, name: str) -> bytes:
    if v is None:
        return b"N"
    if isinstance(v, bool):
        return b"B\x01" if v else b"B\x00"
    if isinstance(v, int):
        n = abs(v).bit_length() // 8 + 1
        return b"I" + _U64(n) + v.to_bytes(n, "little", signed=True)
    if isinstance(v, float):
        if math.isnan(v):
            raise ValueError(f"{name} must not contain NaN")
        return b"F" + _F64(v)
    if isinstance(v, str):
        try:
            data = v.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{name} contains a str not encodable as UTF-8: {exc}") from None
        return b"S" + _U64(len(data)) + data
    if isinstance(v, bytes | bytearray):
        return b"Y" + _U64(len(v)) + bytes(v)
    if isinstance(v, tuple | list):
        return b"L" + _U64(len(v)) + b"".join(_encode_value(x, name) for x in v)
    raise TypeError(
        f"{name} values must be str, bytes, int, bool, float, None, tuple or list, "
        f"got {type(v).__name__}"
    )
