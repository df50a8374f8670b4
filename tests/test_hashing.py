"""Tests for tiercache.hashing: golden vectors, input forms, chaining, isolation, errors.

The golden vectors are checked twice: against hard-coded hex (computed once from the
implementation) and against ``_ref_keys``, an independent re-implementation of the
byte format documented in tiercache/hashing.py and docs/hashing.md that uses only
plain ``struct`` and ``xxhash`` calls. If the code and the documented format
drift apart, one of the two checks fails.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercache.hashing import (
    FORMAT_VERSION,
    group_keys,
    make_namespace,
    prefix_hashes,
    root_hash,
)

NS = "test-ns"
TOKENS = list(range(1, 11))  # block_size 4 -> two full blocks, a partial block of 2
REQUEST_EXTRA = ("lora-a", 7, -129, None, True, 1.5, b"\x00\x01", ("x", [-1, 300]))

GOLDEN_ROOT = "e9814ca9fc719b6f56c0d8d4eb6eff57"
GOLDEN_PLAIN = ["c1ae35f09232ab47a5bdd87467caec85", "43ec58aed04d86091d8dd03c62f59008"]
GOLDEN_REQUEST_EXTRA = ["1e61fe1cdf288ca2a4aaaefc4cc17fab", "c22b0ad4fbfd8df150fa9f987b6379bb"]
GOLDEN_BLOCK_EXTRA = ["c1ae35f09232ab47a5bdd87467caec85", "3afc86b0d175902210f67261c378ad78"]


# --- independent reference implementation of the documented byte format ------


def _ref_enc(v) -> bytes:
    u64 = lambda n: struct.pack("<Q", n)  # noqa: E731
    if v is None:
        return b"N"
    if v is True or v is False:
        return b"B" + bytes([int(v)])
    if isinstance(v, int):
        n = abs(v).bit_length() // 8 + 1
        return b"I" + u64(n) + v.to_bytes(n, "little", signed=True)
    if isinstance(v, float):
        return b"F" + struct.pack("<d", v)
    if isinstance(v, str):
        return b"S" + u64(len(v.encode())) + v.encode()
    if isinstance(v, bytes):
        return b"Y" + u64(len(v)) + v
    return b"L" + u64(len(v)) + b"".join(_ref_enc(x) for x in v)


def _ref_keys(tokens, block_size, namespace, extras=None) -> list[bytes]:
    """extras: {block_index: tuple of values} (request-level extra is {0: ...})."""
    ns = namespace.encode() if isinstance(namespace, str) else namespace
    parent = xxhash.xxh3_128(b"tiercache/prefix/v1\x00" + ns).digest()
    keys = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        msg = parent + b"".join(struct.pack("<I", t) for t in block)
        values = (extras or {}).get(i, ())
        if values:
            msg += _ref_enc(tuple(values))
        parent = xxhash.xxh3_128(msg).digest()
        keys.append(parent)
    return keys


# --- golden vectors and determinism -----------------------------------------------


def test_golden_vectors_match_hardcoded_hex_and_documented_format():
    assert FORMAT_VERSION == 1
    assert root_hash(NS).hex() == GOLDEN_ROOT
    plain = prefix_hashes(TOKENS, 4, namespace=NS)
    request = prefix_hashes(TOKENS, 4, namespace=NS, extra_keys=REQUEST_EXTRA)
    per_block = prefix_hashes(TOKENS, 4, namespace=NS, extra_keys={1: ("img", 2**70)})
    assert [k.hex() for k in plain] == GOLDEN_PLAIN
    assert [k.hex() for k in request] == GOLDEN_REQUEST_EXTRA
    assert [k.hex() for k in per_block] == GOLDEN_BLOCK_EXTRA
    # The same values, recomputed from the documented bytes with plain xxhash calls.
    assert plain == _ref_keys(TOKENS, 4, NS)
    assert request == _ref_keys(TOKENS, 4, NS, {0: REQUEST_EXTRA})
    assert per_block == _ref_keys(TOKENS, 4, NS, {1: ("img", 2**70)})


def test_golden_namespace_string():
    ns = make_namespace(
        model="meta-llama/Llama-3.1-8B",
        dtype="bfloat16",
        block_size=16,
        layout="NHD",
        tp_size=2,
        tp_rank=1,
    )
    assert ns == (
        'tiercache-ns/v1:{"block_size":16,"dtype":"bfloat16","extra":"","layout":"NHD",'
        '"model":"meta-llama/Llama-3.1-8B","tp_rank":1,"tp_size":2}'
    )


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_keys_identical_in_subprocess_with_other_hash_seed(seed):
    code = (
        "import json; from tiercache.hashing import prefix_hashes as p\n"
        f"ks = p({TOKENS!r}, 4, namespace={NS!r}, extra_keys={REQUEST_EXTRA!r})\n"
        f"print(json.dumps([[k.hex() for k in p({TOKENS!r}, 4, namespace={NS!r})],"
        " [k.hex() for k in ks]]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == [GOLDEN_PLAIN, GOLDEN_REQUEST_EXTRA]


def test_keys_are_16_bytes_and_empty_input_gives_no_keys():
    keys = prefix_hashes(list(range(64)), 16, namespace=NS)
    assert len(keys) == 4
    assert all(type(k) is bytes and len(k) == 16 for k in keys)
    assert prefix_hashes([], 16, namespace=NS) == []
    assert prefix_hashes(np.array([], dtype=np.int64), 16, namespace=NS) == []
    assert prefix_hashes(list(range(15)), 16, namespace=NS) == []


# --- input forms --------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        tuple,
        lambda t: np.array(t, dtype=np.int32),
        lambda t: np.array(t, dtype=np.int64),
        lambda t: np.array(t, dtype=np.uint32),
        lambda t: np.array(t, dtype=np.uint64),
        lambda t: np.array(t, dtype=np.uint16),
        lambda t: np.array(t, dtype=">i8"),  # big-endian input is byte-swapped
        lambda t: np.repeat(np.array(t, dtype=np.int64), 2)[::2],  # non-contiguous view
        lambda t: torch.tensor(t, dtype=torch.int32),
        lambda t: torch.tensor(t, dtype=torch.int64),
        lambda t: torch.tensor(t).repeat_interleave(2)[::2],
        lambda t: [np.int64(x) for x in t],
    ],
)
def test_input_forms_give_identical_keys(make):
    tokens = [(i * 7919) % 30000 for i in range(51)]
    expected = prefix_hashes(tokens, 8, namespace=NS)
    assert len(expected) == 6
    assert prefix_hashes(make(tokens), 8, namespace=NS) == expected


@pytest.mark.parametrize("dtype", [np.uint32, np.int64, np.uint64])
def test_largest_token_id_is_accepted(dtype):
    tokens = [0, 2**32 - 1, 2**31, 2**31 - 1]
    expected = _ref_keys(tokens, 2, NS)
    assert prefix_hashes(tokens, 2, namespace=NS) == expected
    assert prefix_hashes(np.array(tokens, dtype=dtype), 2, namespace=NS) == expected


def test_str_and_bytes_namespace_are_the_same():
    assert prefix_hashes(TOKENS, 2, namespace="ns") == prefix_hashes(TOKENS, 2, namespace=b"ns")


def test_cuda_tensor_is_moved_to_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    t = torch.arange(64, dtype=torch.int64)
    assert prefix_hashes(t.cuda(), 16, namespace=NS) == prefix_hashes(t, 16, namespace=NS)


# --- chaining ------------------------------------------------------------------------


def test_shared_prefix_shares_leading_keys_then_diverges():
    a = list(range(100))
    b = a[:40] + [7] * 60  # blocks 0..4 (block_size 8) equal, block 5 differs
    ka, kb = prefix_hashes(a, 8, namespace=NS), prefix_hashes(b, 8, namespace=NS)
    assert ka[:5] == kb[:5]
    assert all(x != y for x, y in zip(ka[5:], kb[5:], strict=True))


@pytest.mark.parametrize("i", [0, 3, 7])
def test_changing_one_token_changes_keys_from_its_block_on(i):
    tokens = list(range(64))
    base = prefix_hashes(tokens, 8, namespace=NS)
    tokens[i * 8 + 5] += 1
    changed = prefix_hashes(tokens, 8, namespace=NS)
    assert changed[:i] == base[:i]
    assert all(x != y for x, y in zip(changed[i:], base[i:], strict=True))


def test_partial_trailing_block_is_ignored():
    base = prefix_hashes(list(range(32)), 8, namespace=NS)
    assert prefix_hashes(list(range(39)), 8, namespace=NS) == base
    assert prefix_hashes(list(range(32)) + [99] * 7, 8, namespace=NS) == base
    assert len(prefix_hashes(list(range(40)), 8, namespace=NS)) == 5


def test_block_size_changes_keys():
    tokens = list(range(64))
    assert prefix_hashes(tokens, 8, namespace=NS)[0] != prefix_hashes(tokens, 16, namespace=NS)[0]


# --- namespace and extra isolation --------------------------------------------------


def test_namespace_changes_every_key():
    a = prefix_hashes(TOKENS, 2, namespace="a")
    b = prefix_hashes(TOKENS, 2, namespace="b")
    assert all(x != y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "field",
    [
        {"model": "other"},
        {"dtype": "float16"},
        {"block_size": 32},
        {"layout": "HND"},
        {"tp_size": 4, "tp_rank": 1},
        {"tp_size": 2, "tp_rank": 0},
        {"extra": "kv-quant"},
    ],
)
def test_every_namespace_field_changes_the_namespace_and_root(field):
    base = {"model": "m", "dtype": "bfloat16", "block_size": 16, "tp_size": 2, "tp_rank": 1}
    ns_a, ns_b = make_namespace(**base), make_namespace(**{**base, **field})
    assert ns_a != ns_b
    assert root_hash(ns_a) != root_hash(ns_b)


def test_request_extra_changes_every_key_and_equals_block_zero_extra():
    plain = prefix_hashes(TOKENS, 2, namespace=NS)
    lora_a = prefix_hashes(TOKENS, 2, namespace=NS, extra_keys=["lora-a"])
    lora_b = prefix_hashes(TOKENS, 2, namespace=NS, extra_keys=("lora-b",))
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain, lora_a, lora_b, strict=True))
    assert lora_a == prefix_hashes(TOKENS, 2, namespace=NS, extra_keys={0: ("lora-a",)})


@pytest.mark.parametrize("j", [0, 2, 4])
def test_per_block_extra_changes_keys_from_its_block_on(j):
    plain = prefix_hashes(TOKENS, 2, namespace=NS)
    extra = prefix_hashes(TOKENS, 2, namespace=NS, extra_keys={j: (b"image-hash",)})
    assert extra[:j] == plain[:j]
    assert all(x != y for x, y in zip(extra[j:], plain[j:], strict=True))


def test_empty_and_unused_extras_equal_no_extra():
    plain = prefix_hashes(TOKENS, 2, namespace=NS)
    for extra in [(), [], {}, {0: (), 3: []}, {5: ("beyond the last full block",)}, {99: (1,)}]:
        assert prefix_hashes(TOKENS, 2, namespace=NS, extra_keys=extra) == plain


def test_several_per_block_extras_match_reference():
    tokens = list(range(40))
    extras = {0: ("salt",), 3: (1, 2), 4: ("x",), 9: (None,)}
    got = prefix_hashes(tokens, 4, namespace=NS, extra_keys=extras)
    assert got == _ref_keys(tokens, 4, NS, extras)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("ab",), ("a", "b")),
        (("ab",), (b"ab",)),
        ((1,), (True,)),
        ((0,), (False,)),
        ((1,), (1.0,)),
        ((0.0,), (-0.0,)),
        ((None,), ("",)),
        ((("a", "b"),), ("a", "b")),
        ((("a",), "b"), ("a", ("b",))),
        ((255,), (-1,)),
        ((b"",), ("",)),
        (((),), (None,)),
    ],
)
def test_extra_encoding_is_unambiguous(a, b):
    ka = prefix_hashes(TOKENS, 2, namespace=NS, extra_keys=a)
    kb = prefix_hashes(TOKENS, 2, namespace=NS, extra_keys=b)
    assert ka[0] != kb[0]


def test_list_and_tuple_extras_are_equal():
    a = prefix_hashes(TOKENS, 2, namespace=NS, extra_keys=[("a", [1, 2])])
    b = prefix_hashes(TOKENS, 2, namespace=NS, extra_keys=(["a", (1, 2)],))
    assert a == b


# --- property tests -------------------------------------------------------------------

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=64)
extra_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner),
    max_leaves=6,
)
extras_maps = st.dictionaries(st.integers(0, 8), st.lists(extra_values, max_size=3), max_size=3)


def _canon(v):
    """Type-aware identity of an extra value (1 == True == 1.0 and 0.0 == -0.0 in Python)."""
    if isinstance(v, list | tuple):
        return ("L", tuple(_canon(x) for x in v))
    if isinstance(v, float):
        return ("F", struct.pack("<d", v))
    return (type(v).__name__, v)


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, bs=st.integers(1, 9), extras=extras_maps)
def test_property_matches_reference_and_is_deterministic(tokens, bs, extras):
    got = prefix_hashes(tokens, bs, namespace=NS, extra_keys=extras)
    assert got == _ref_keys(tokens, bs, NS, extras)
    assert got == prefix_hashes(
        np.array(tokens, dtype=np.uint32), bs, namespace=NS, extra_keys=extras
    )


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, bs=st.integers(1, 9), k=st.integers(0, 10))
def test_property_prefix(tokens, bs, k):
    full = prefix_hashes(tokens, bs, namespace=NS)
    assert prefix_hashes(tokens[: k * bs], bs, namespace=NS) == full[:k]


@settings(max_examples=100, deadline=None)
@given(
    a=st.tuples(token_lists, extras_maps),
    b=st.tuples(token_lists, extras_maps),
    bs=st.integers(1, 4),
)
def test_property_injective(a, b, bs):
    """Key i is equal exactly when all tokens and extras of blocks 0..i are equal."""
    (ta, ea), (tb, eb) = a, b
    ka = prefix_hashes(ta, bs, namespace=NS, extra_keys=ea)
    kb = prefix_hashes(tb, bs, namespace=NS, extra_keys=eb)
    assert len(set(ka)) == len(ka)  # a chain never repeats a key
    for i in range(min(len(ka), len(kb))):
        same_tokens = ta[: (i + 1) * bs] == tb[: (i + 1) * bs]
        same_extras = all(
            _canon(tuple(ea.get(j, ()))) == _canon(tuple(eb.get(j, ()))) for j in range(i + 1)
        )
        assert (ka[i] == kb[i]) == (same_tokens and same_extras)


# --- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "exc", "match"),
    [
        ([1, -1], ValueError, r"token_ids\[1\]"),
        ([2**32], ValueError, r"token_ids\[0\]"),
        ([2**70], ValueError, "token_ids"),
        (np.array([3, -5], dtype=np.int8), ValueError, r"token_ids\[1\]"),
        (np.array([2**32], dtype=np.int64), ValueError, "token_ids"),
        (np.array([2**40], dtype=np.uint64), ValueError, "token_ids"),
        (torch.tensor([-1]), ValueError, "token_ids"),
        ([1, 2.0], TypeError, r"token_ids\[1\]"),
        ([1, "2"], TypeError, "token_ids"),
        ([None], TypeError, "token_ids"),
        (np.array([1.0, 2.0]), TypeError, "token_ids"),
        (np.array([True, False]), TypeError, "token_ids"),
        (np.array(["1"]), TypeError, "token_ids"),
        (np.array([1, 2], dtype=object), TypeError, "token_ids"),
        (torch.tensor([1.0]), TypeError, "token_ids"),
        (torch.tensor([True]), TypeError, "token_ids"),
        (np.zeros((2, 2), dtype=np.int64), ValueError, "token_ids"),
        (np.int64(3), TypeError, "token_ids"),
        (torch.zeros((2, 2), dtype=torch.int64), ValueError, "token_ids"),
        ("1234", TypeError, "token_ids"),
        (b"1234", TypeError, "token_ids"),
        (iter([1, 2]), TypeError, "token_ids"),
        (5, TypeError, "token_ids"),
    ],
)
def test_bad_token_ids(tokens, exc, match):
    with pytest.raises(exc, match=match):
        prefix_hashes(tokens, 1, namespace=NS)


@pytest.mark.parametrize("bs", [0, -1, 1.0, 16.0, "16", None, True])
def test_bad_block_size(bs):
    with pytest.raises(ValueError, match="block_size"):
        prefix_hashes(TOKENS, bs, namespace=NS)


@pytest.mark.parametrize(
    ("ns", "exc"), [("", ValueError), (b"", ValueError), (None, TypeError), (1, TypeError)]
)
def test_bad_namespace(ns, exc):
    with pytest.raises(exc, match="namespace"):
        prefix_hashes(TOKENS, 2, namespace=ns)
    with pytest.raises(exc, match="namespace"):
        root_hash(ns)


@pytest.mark.parametrize(
    ("extra", "exc"),
    [
        ("salt", TypeError),  # a bare str is not a sequence of values
        (b"salt", TypeError),
        (5, TypeError),
        ({0: "salt"}, TypeError),  # a mapping value must be a sequence
        ({0: 5}, TypeError),
        ({0: None}, TypeError),
        ({-1: ("x",)}, ValueError),
        ({"0": ("x",)}, ValueError),
        ({1.0: ("x",)}, ValueError),
        ({True: ("x",)}, ValueError),
        ((object(),), TypeError),
        (({"a": 1},), TypeError),
        (({1, 2},), TypeError),
        ((np.int64(1),), TypeError),
        ((float("nan"),), ValueError),
        (("\ud800",), ValueError),  # lone surrogate: not UTF-8 encodable
        ({7: (object(),)}, TypeError),  # validated even beyond the full blocks
    ],
)
def test_bad_extra_keys(extra, exc):
    with pytest.raises(exc, match="extra_keys"):
        prefix_hashes(TOKENS, 2, namespace=NS, extra_keys=extra)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"model": ""}, ValueError, "model"),
        ({"model": None}, TypeError, "model"),
        ({"dtype": ""}, ValueError, "dtype"),
        ({"dtype": torch.float16}, TypeError, "dtype"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": 16.0}, ValueError, "block_size"),
        ({"tp_size": 0}, ValueError, "tp_size"),
        ({"tp_rank": -1}, ValueError, "tp_rank"),
        ({"tp_size": 2, "tp_rank": 2}, ValueError, "tp_rank"),
        ({"layout": None}, TypeError, "layout"),
        ({"extra": 3}, TypeError, "extra"),
    ],
)
def test_bad_make_namespace(kwargs, exc, match):
    base = {"model": "m", "dtype": "bfloat16", "block_size": 16}
    with pytest.raises(exc, match=match):
        make_namespace(**{**base, **kwargs})


# --- group keys (hybrid models: one key per block and KV cache group) ---------------------


def test_group_keys_empty_group_is_the_plain_keys():
    # A single-group store keeps its keys: the empty group name changes nothing.
    keys = prefix_hashes(list(range(64)), 16, namespace="m")
    assert group_keys(keys, "") == keys


def test_group_keys_golden_and_distinct_per_group():
    keys = prefix_hashes(list(range(32)), 16, namespace="m")
    g = "sliding_window/64/model.layers.0.self_attn.attn"
    name = g.encode()
    want = [
        xxhash.xxh3_128_digest(b"tiercache/group/v1\x00" + struct.pack("<Q", len(name)) + name + k)
        for k in keys
    ]
    assert group_keys(keys, g) == want
    other = group_keys(keys, "full_attention/model.layers.2.self_attn.attn")
    assert len(set(want) | set(other) | set(keys)) == 3 * len(keys)


def test_group_keys_rejects_non_str_group():
    with pytest.raises(TypeError, match="group"):
        group_keys([b"x" * 16], b"g")  # type: ignore[arg-type]
