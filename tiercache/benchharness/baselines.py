"""Same-run baselines: each tiercache path timed next to the simplest code that moves the same
bytes, so a report can print ratios that hold on any machine.

Primitives (each returns a `Pair`: tiercache's rate, the baseline's rate, their units):
- `hashing_pair`: `prefix_hashes` vs a hashlib sha256 chain over the same uint32 token bytes.
- `cpu_tier_pair`: `CPUTier.write`/`read` of a batch vs one torch `copy_` of the same bytes.
- `nvme_pair`: `NVMeTier.write`/`read` vs raw `os.pwrite`/`os.pread` on an O_DIRECT file
  (aligned buffers, the tier's slot size); both fall back to buffered I/O together where the
  filesystem refuses O_DIRECT, and the pair says so.
- `lmdb_pair`: `LMDBTier` (compression off) vs raw py-lmdb put/get, same environment flags.
- `memcpy_bps(nbytes)`: torch copy bandwidth, for "bytes moved vs memcpy of the same bytes".

Contenders alternate within each run and the median of `runs` is kept.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lmdb
import numpy as np
import torch

from tiercache.hashing import prefix_hashes

MB = 1e6


@dataclass(frozen=True)
class Pair:
    """A tiercache rate and its same-run baseline rate (higher is better for both)."""

    name: str
    ours: float
    base: float
    unit: str
    baseline: str
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.base if self.base else float("nan")


def _median_rates(
    fns: dict[str, Callable[[], float]], amount: float, runs: int
) -> dict[str, float]:
    """amount / seconds for each fn (which returns its seconds), medians over runs, interleaved."""
    secs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            secs[k].append(fn())
    return {k: amount / statistics.median(v) for k, v in secs.items()}


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def sha256_chain(data: bytes, block_size: int) -> list[bytes]:
    """The baseline hash: key[i] = sha256(key[i-1] + uint32 tokens of block i)[:16]."""
    step = 4 * block_size
    parent = b"\0" * 16
    out = []
    for off in range(0, len(data) - step + 1, step):
        parent = hashlib.sha256(parent + data[off : off + step]).digest()[:16]
        out.append(parent)
    return out


def hashing_pair(n_tokens: int = 200_000, block_size: int = 16, runs: int = 5) -> Pair:
    """Prefix hashing (from an int64 array, validation included) vs a sha256 chain over the
    uint32 bytes prepared in advance."""
    tokens = np.random.default_rng(0).integers(0, 150_000, n_tokens, dtype=np.int64)
    raw = tokens.astype(np.uint32).tobytes()
    n_blocks = n_tokens // block_size
    rates = _median_rates(
        {
            "ours": lambda: _timed(lambda: prefix_hashes(tokens, block_size, namespace="bench")),
            "base": lambda: _timed(lambda: sha256_chain(raw, block_size)),
        },
        n_blocks,
        runs,
    )
    return Pair(
        f"prefix hashing, {block_size}-token blocks",
        rates["ours"],
        rates["base"],
        "blocks/s",
        "hashlib sha256 chain",
    )


def memcpy_bps(nbytes: int, runs: int = 5, *, cap: int = 256 * 2**20) -> float:
    """Median bytes/s of one torch `copy_` of `nbytes` (at most `cap`, at least 4 KiB; pages
    faulted in first)."""
    n = max(4096, min(nbytes, cap))
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [_timed(lambda: dst.copy_(src)) for _ in range(runs)]
    return n / statistics.median(times)


def _tier_rates(
    tier: Any, raw: dict[str, Callable[[torch.Tensor, torch.Tensor], object]], runs: int, what: str
) -> dict[str, float]:
    """MB/s of `tier`'s batched write ("tier_w") and read ("tier_r") of random blocks that fill
    it, and of each `raw(src, dst)` baseline moving the same bytes: medians over `runs`,
    interleaved. Closes the tier; AssertionError if it read back other bytes."""
    n = tier.capacity_blocks
    keys = [i.to_bytes(16, "big") for i in range(n)]
    slots = tier.allocate(keys)
    assert slots is not None
    src = torch.randint(0, 256, (n, tier.block_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    tier.write(slots, src, keys)
    fns = {
        "tier_w": lambda: _timed(lambda: tier.write(slots, src, keys)),
        "tier_r": lambda: _timed(lambda: tier.read(slots, dst, keys)),
    }
    for name, fn in raw.items():
        fns[name] = lambda fn=fn: _timed(lambda: fn(src, dst))
    rates = _median_rates(fns, n * tier.block_bytes / MB, runs)
    tier.read(slots, dst, keys)
    ok = torch.equal(dst, src)
    tier.close()
    if not ok:
        raise AssertionError(f"{what} tier read back different bytes")
    return rates


def cpu_tier_pair(block_bytes: int = 256 * 1024, n_blocks: int = 256, runs: int = 5) -> list[Pair]:
    """CPUTier batched write and read vs one copy_ of the same bytes."""
    from tiercache.tiers.cpu import CPUTier

    tier = CPUTier(block_bytes=block_bytes, capacity_blocks=n_blocks, pin_memory=False)
    flat = torch.empty((n_blocks, block_bytes), dtype=torch.uint8)
    rates = _tier_rates(tier, {"copy": lambda src, _: flat.copy_(src)}, runs, "CPU")
    base = "torch copy_ of the same bytes"
    return [
        Pair("CPU tier write", rates["tier_w"], rates["copy"], "MB/s", base),
        Pair("CPU tier read", rates["tier_r"], rates["copy"], "MB/s", base),
    ]


class _RawDirect:
    """The O_DIRECT baseline: pwrite/pread of whole aligned slots, nothing else."""

    def __init__(self, path: str, slot_bytes: int, n: int) -> None:
        self.slot = slot_bytes
        self.direct = True
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            os.posix_fallocate(self.fd, 0, slot_bytes * n)
            self.buf = mmap.mmap(-1, slot_bytes)  # page-aligned, as O_DIRECT needs
            os.pwrite(self.fd, self.buf, 0)
        except OSError:  # the filesystem refuses O_DIRECT (tmpfs, some overlays)
            self.direct = False
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            os.posix_fallocate(self.fd, 0, slot_bytes * n)
            self.buf = mmap.mmap(-1, slot_bytes)

    def write(self, slots: list[int]) -> None:
        for s in slots:
            os.pwrite(self.fd, self.buf, s * self.slot)

    def read(self, slots: list[int]) -> None:
        for s in slots:
            os.preadv(self.fd, [self.buf], s * self.slot)

    def close(self) -> None:
        os.close(self.fd)
        self.buf.close()


def nvme_pair(
    directory: str | None = None, block_bytes: int = 256 * 1024, n_blocks: int = 128, runs: int = 3
) -> list[Pair]:
    """NVMeTier write/read (fsync never, direct I/O) vs raw O_DIRECT pwrite/pread of slots."""
    from tiercache.tiers.format import HEADER_SIZE
    from tiercache.tiers.nvme import ALIGN, NVMeTier

    with tempfile.TemporaryDirectory(
        prefix="tiercache-bench-nvme-", dir=directory, ignore_cleanup_errors=True
    ) as root:
        slot_bytes = -(-(HEADER_SIZE + block_bytes) // ALIGN) * ALIGN
        raw = _RawDirect(os.path.join(root, "raw"), slot_bytes, n_blocks)
        tier = NVMeTier(
            block_bytes=block_bytes,
            capacity_blocks=n_blocks,
            path=os.path.join(root, "tier"),
            fsync="never",
            direct=raw.direct,
        )
        order = list(range(n_blocks))
        raws = {"raw_w": lambda *_: raw.write(order), "raw_r": lambda *_: raw.read(order)}
        try:
            rates = _tier_rates(tier, raws, runs, "NVMe")
        finally:
            raw.close()
        note = "" if raw.direct else "O_DIRECT refused here: both buffered"
        base = "raw O_DIRECT pwrite/pread" if raw.direct else "raw pwrite/pread"
        return [
            Pair("NVMe tier write", rates["tier_w"], rates["raw_w"], "MB/s", base, note),
            Pair("NVMe tier read", rates["tier_r"], rates["raw_r"], "MB/s", base, note),
        ]


def open_raw_lmdb(path: str, map_size: int) -> tuple[lmdb.Environment, Any]:
    """The raw py-lmdb baseline's environment: the LMDB tier's flags (writemap, no sync) and
    one named database, so tier and baseline differ only in what the tier adds."""
    env = lmdb.open(
        path, map_size=map_size, max_dbs=2, writemap=True, sync=False, metasync=False, mode=0o600
    )
    return env, env.open_db(b"blocks")


def raw_lmdb_put(env: lmdb.Environment, db: Any, keys: Sequence[bytes], rows: Any) -> None:
    """Baseline: put row i under keys[i], one write transaction."""
    with env.begin(write=True, db=db) as txn:
        for k, row in zip(keys, rows, strict=True):
            txn.put(k, row)


def raw_lmdb_get(env: lmdb.Environment, db: Any, keys: Sequence[bytes], out: np.ndarray) -> None:
    """Baseline: copy the value of keys[j] into out[j], one zero-copy read transaction."""
    with env.begin(db=db, buffers=True) as txn:
        for j, k in enumerate(keys):
            np.copyto(out[j], np.frombuffer(txn.get(k), dtype=np.uint8))


def lmdb_pair(
    directory: str | None = None, block_bytes: int = 64 * 1024, n_blocks: int = 512, runs: int = 3
) -> list[Pair]:
    """LMDBTier (compression none) write/read vs raw py-lmdb put/get of the same values, one
    transaction per batch, with the tier's environment flags (writemap, no sync)."""
    from tiercache.tiers.lmdb import LMDBTier, map_size_for

    with tempfile.TemporaryDirectory(
        prefix="tiercache-bench-lmdb-", dir=directory, ignore_cleanup_errors=True
    ) as root:
        # Rewriting every value each run needs room for old and new pages at once.
        env, db = open_raw_lmdb(os.path.join(root, "raw"), 4 * map_size_for(n_blocks, block_bytes))
        tier = LMDBTier(
            block_bytes=block_bytes,
            capacity_blocks=n_blocks,
            path=os.path.join(root, "tier"),
            compression="none",
            sync="never",
        )
        keys = [i.to_bytes(16, "big") for i in range(n_blocks)]  # the tier's (`_tier_rates`)
        raws = {
            "raw_w": lambda src, _: raw_lmdb_put(env, db, keys, src.numpy()),
            "raw_r": lambda _, dst: raw_lmdb_get(env, db, keys, dst.numpy()),
        }
        try:
            rates = _tier_rates(tier, raws, runs, "LMDB")
        finally:
            env.close()
        base = "raw py-lmdb put/get"
        return [
            Pair("LMDB tier write (no compression)", rates["tier_w"], rates["raw_w"], "MB/s", base),
            Pair("LMDB tier read (no compression)", rates["tier_r"], rates["raw_r"], "MB/s", base),
        ]
