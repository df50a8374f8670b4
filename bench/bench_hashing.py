"""Benchmark prefix_hashes against a hashlib.sha256 chain over the same blocks.

pytest-benchmark:  .venv/bin/pytest bench/bench_hashing.py --benchmark-only
Script (same run): .venv/bin/python bench/bench_hashing.py [--repeats N] [--variants]

The script interleaves the contenders N times on one 100k-token input (each sample
the mean of 5 back-to-back calls) and prints the median blocks/s of each and their
ratio. ``prefix_hashes`` is timed end to end
from an int64 numpy array (validation and uint32 conversion included); the sha256
baseline gets the uint32 bytes ready-made, and is timed both as a plain slicing loop
and with the same struct.iter_unpack loop that prefix_hashes uses, so the ratio is
not flattered by loop tricks. ``--variants`` times the inner-loop designs considered
for prefix_hashes (xxh3 over the same bytes, no validation).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import struct
import time
from collections.abc import Callable

import numpy as np
import pytest
import xxhash

from tiercache.hashing import prefix_hashes

N_TOKENS = 100_000
NAMESPACE = "bench"


def make_tokens(n: int = N_TOKENS) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 150_000, n, dtype=np.int64)


def sha256_chain(data: bytes, block_size: int) -> list[bytes]:
    """Baseline: key[i] = sha256(key[i-1] + block bytes), a plain slicing loop."""
    step = 4 * block_size
    sha256 = hashlib.sha256
    parent = sha256(NAMESPACE.encode()).digest()
    out: list[bytes] = []
    append = out.append
    for off in range(0, len(data) // step * step, step):
        parent = sha256(parent + data[off : off + step]).digest()
        append(parent)
    return out


def sha256_chain_unpack(data: bytes, block_size: int) -> list[bytes]:
    """Baseline with the same struct.iter_unpack block loop that prefix_hashes uses."""
    step = 4 * block_size
    sha256 = hashlib.sha256
    parent = sha256(NAMESPACE.encode()).digest()
    out: list[bytes] = []
    append = out.append
    for (block,) in struct.iter_unpack(f"{step}s", data[: len(data) // step * step]):
        parent = sha256(parent + block).digest()
        append(parent)
    return out


# --- inner-loop variants considered for prefix_hashes (xxh3 over ready bytes) ----------


def xxh_slice_concat(data: bytes, block_size: int) -> list[bytes]:
    step, digest, parent, out = 4 * block_size, xxhash.xxh3_128_digest, b"\0" * 16, []
    mv = memoryview(data)
    for off in range(0, len(data) // step * step, step):
        parent = digest(parent + mv[off : off + step])
        out.append(parent)
    return out


def xxh_streaming(data: bytes, block_size: int) -> list[bytes]:
    step, new, parent, out = 4 * block_size, xxhash.xxh3_128, b"\0" * 16, []
    mv = memoryview(data)
    for off in range(0, len(data) // step * step, step):
        h = new(parent)
        h.update(mv[off : off + step])
        parent = h.digest()
        out.append(parent)
    return out


def xxh_iter_unpack(data: bytes, block_size: int) -> list[bytes]:
    step, digest, parent, out = 4 * block_size, xxhash.xxh3_128_digest, b"\0" * 16, []
    for (block,) in struct.iter_unpack(f"{step}s", data[: len(data) // step * step]):
        parent = digest(parent + block)
        out.append(parent)
    return out


# --- pytest-benchmark -----------------------------------------------------------------

BLOCK_SIZES = [16, 32, 256]


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return make_tokens()


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefix_hashes_numpy(benchmark, tokens, block_size):
    keys = benchmark(prefix_hashes, tokens, block_size, namespace=NAMESPACE)
    assert len(keys) == N_TOKENS // block_size


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefix_hashes_list(benchmark, tokens, block_size):
    as_list = tokens.tolist()
    keys = benchmark(prefix_hashes, as_list, block_size, namespace=NAMESPACE)
    assert len(keys) == N_TOKENS // block_size


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_sha256_chain(benchmark, tokens, block_size):
    data = tokens.astype("<u4").tobytes()
    keys = benchmark(sha256_chain, data, block_size)
    assert len(keys) == N_TOKENS // block_size


# --- script mode ----------------------------------------------------------------------


def _median_seconds(
    fns: dict[str, Callable[[], object]], repeats: int, inner: int = 5
) -> dict[str, float]:
    """Median seconds per call. Each sample is the mean of ``inner`` back-to-back calls
    (so no contender runs with caches cooled by another), and samples are interleaved
    across contenders (so machine drift affects every contender alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--variants", action="store_true", help="also time inner-loop designs")
    args = parser.parse_args()
    tokens = make_tokens()
    as_list = tokens.tolist()
    data = tokens.astype("<u4").tobytes()
    print(f"{N_TOKENS} tokens, median of {args.repeats} interleaved runs, blocks/s")
    header = f"{'bs':>4} {'ours(np)':>10} {'ours(list)':>10} {'sha256':>10} {'sha256*':>10}"
    print(header + "  ratio(np/sha256)  ratio(np/sha256*)  ratio(list/sha256)")
    for bs in BLOCK_SIZES:
        fns: dict[str, Callable[[], object]] = {
            "np": lambda bs=bs: prefix_hashes(tokens, bs, namespace=NAMESPACE),
            "list": lambda bs=bs: prefix_hashes(as_list, bs, namespace=NAMESPACE),
            "sha": lambda bs=bs: sha256_chain(data, bs),
            "sha*": lambda bs=bs: sha256_chain_unpack(data, bs),
        }
        med = _median_seconds(fns, args.repeats)
        rate = {k: (N_TOKENS // bs) / v for k, v in med.items()}
        print(
            f"{bs:>4} {rate['np']:>10.3g} {rate['list']:>10.3g} {rate['sha']:>10.3g} "
            f"{rate['sha*']:>10.3g}  {rate['np'] / rate['sha']:>16.2f}  "
            f"{rate['np'] / rate['sha*']:>17.2f}  {rate['list'] / rate['sha']:>18.2f}"
        )
    print("sha256* = sha256 chain using the same struct.iter_unpack loop as prefix_hashes")
    if args.variants:
        print("\ninner-loop variants (xxh3-128 over ready bytes), blocks/s")
        for bs in BLOCK_SIZES:
            variants = (xxh_slice_concat, xxh_streaming, xxh_iter_unpack)
            fns = {f.__name__: (lambda f=f, bs=bs: f(data, bs)) for f in variants}
            med = _median_seconds(fns, args.repeats)
            cells = "  ".join(f"{k}={(N_TOKENS // bs) / v:.3g}" for k, v in med.items())
            print(f"{bs:>4} {cells}")


if __name__ == "__main__":
    main()
