"""pytest-benchmark micro-benchmarks, one group per component, each next to its baseline.

Run (not part of the default `pytest`, whose testpaths is tests/):
    .venv/bin/pytest bench/test_micro.py --benchmark-only -p no:cacheprovider
    .venv/bin/pytest bench/test_micro.py --benchmark-only --benchmark-group-by=group

Groups (compare rows within a group; the machine is shared and noisy, read ratios):
    hashing      prefix_hashes vs a hashlib sha256 chain, 16- and 256-token blocks
    policy       insert_many / touch / evict(64) on LRU and ARC at capacity (64k keys)
    manager      one request's call sequence (lookup, load, store, touch, complete), hit and
                 miss heavy, LRU and ARC, vs the same sequence on one OrderedDict
    tier-<kind>  batched write and read of 64 blocks of 64 KiB per tier (cpu, gpu on CUDA,
                 nvme, lmdb) vs torch copy_ (cpu, gpu), raw O_DIRECT (nvme), raw py-lmdb (lmdb)
    compression  LMDB tier with zstd on bf16-like data vs compression off, and zstandard
                 alone on the same bytes
"""

from __future__ import annotations

import mmap
import os
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch
import zstandard
from pytest_benchmark.fixture import BenchmarkFixture

from tiercache.benchharness.baselines import sha256_chain
from tiercache.hashing import prefix_hashes
from tiercache.manager import OffloadingManager
from tiercache.policies import ARCPolicy, LRUPolicy
from tiercache.tiers.cpu import CPUTier

BLOCK = 64 * 1024
BATCH = 64
_rng = random.Random(0)


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [(salt << 64 | i).to_bytes(16, "big") for i in range(n)]


def blocks(n: int = BATCH, block: int = BLOCK, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, block), dtype=torch.uint8, generator=g)


# -- hashing -------------------------------------------------------------------------------
TOKENS = np.random.default_rng(0).integers(0, 150_000, 65_536, dtype=np.int64)


@pytest.mark.benchmark(group="hashing")
@pytest.mark.parametrize("block_size", [16, 256])
def test_prefix_hashes(benchmark: BenchmarkFixture, block_size: int) -> None:
    out = benchmark(prefix_hashes, TOKENS, block_size, namespace="bench")
    assert len(out) == len(TOKENS) // block_size


@pytest.mark.benchmark(group="hashing")
@pytest.mark.parametrize("block_size", [16, 256])
def test_sha256_chain_baseline(benchmark: BenchmarkFixture, block_size: int) -> None:
    raw = TOKENS.astype(np.uint32).tobytes()
    out = benchmark(sha256_chain, raw, block_size)
    assert len(out) == len(TOKENS) // block_size


# -- policies ------------------------------------------------------------------------------
CAP = 65_536
POLICIES = pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy], ids=["lru", "arc"])


def full_policy(cls: type) -> LRUPolicy | ARCPolicy:
    p = cls(CAP)
    p.insert_many(keys(CAP))
    return p


@pytest.mark.benchmark(group="policy")
@POLICIES
def test_policy_cycle(benchmark: BenchmarkFixture, cls: type) -> None:
    """At capacity: evict 64, insert a new chain of 64, touch it; 192 block-ops a round."""
    p = full_policy(cls)
    fresh = iter([keys(64, salt=s) for s in range(1, 1_000_000)])

    def cycle() -> None:
        chain = next(fresh)
        assert p.evict(64) is not None
        p.insert_many(chain)
        p.touch(chain)

    benchmark(cycle)


@pytest.mark.benchmark(group="policy")
@POLICIES
def test_policy_touch_resident(benchmark: BenchmarkFixture, cls: type) -> None:
    p = full_policy(cls)
    chains = [keys(CAP)[i : i + 64] for i in range(0, CAP, 64)]
    it = iter(chains * 1000)
    benchmark(lambda: p.touch(next(it)))


# -- manager -------------------------------------------------------------------------------
def request_stream(hit_share: float) -> list[list[bytes]]:
    """Chains of 64: a shared head of hit_share*64 keys from 32 prefixes, then fresh keys."""
    heads = [keys(64, salt=10_000 + i) for i in range(32)]
    n_head = int(64 * hit_share)
    return [
        heads[_rng.randrange(32)][:n_head] + keys(64 - n_head, salt=20_000 + r)
        for r in range(20_000)
    ]


def manager_round(m: OffloadingManager, chain: list[bytes]) -> None:
    n = m.lookup(chain) or 0
    if n:
        m.prepare_load(chain[:n])
        m.complete_load(chain[:n])
    out = m.prepare_store(chain[n:]) if n < len(chain) else None
    m.touch(chain)
    if out is not None:
        m.complete_store(out.keys_to_store)


@pytest.mark.benchmark(group="manager")
@pytest.mark.parametrize("hit_share", [0.25, 0.75])
@POLICIES
def test_manager_request(benchmark: BenchmarkFixture, cls: type, hit_share: float) -> None:
    """One 64-block request through the manager (4 block-ops per block)."""
    cap = 8192
    m = OffloadingManager([CPUTier(block_bytes=1, capacity_blocks=cap)], [cls(cap)])
    it = iter(request_stream(hit_share))
    benchmark(lambda: manager_round(m, next(it)))


@pytest.mark.benchmark(group="manager")
@pytest.mark.parametrize("hit_share", [0.25, 0.75])
def test_manager_baseline_ordereddict(benchmark: BenchmarkFixture, hit_share: float) -> None:
    """The same request on one OrderedDict: LRU with no states, pins, events or stats."""
    cap = 8192
    od: OrderedDict[bytes, None] = OrderedDict()
    it = iter(request_stream(hit_share))

    def one() -> None:
        chain = next(it)
        n = 0
        for k in chain:
            if k not in od:
                break
            n += 1
        new = [k for k in chain[n:] if k not in od]
        for _ in range(max(0, len(od) + len(new) - cap)):
            od.popitem(last=False)
        for k in reversed(chain):
            if k in od:
                od.move_to_end(k)
        od.update(dict.fromkeys(new))

    benchmark(one)


# -- tiers -----------------------------------------------------------------------------------
def _roundtrip(tier, benchmark: BenchmarkFixture, op: str) -> None:
    ks = keys(BATCH)
    slots = tier.allocate(ks)
    src, dst = blocks(), torch.empty((BATCH, BLOCK), dtype=torch.uint8)
    tier.write(slots, src, ks)
    if op == "write":
        benchmark(tier.write, slots, src, ks)
    else:
        benchmark(tier.read, slots, dst, ks)
        assert torch.equal(dst, src)
    tier.close()


@pytest.mark.benchmark(group="tier-cpu")
@pytest.mark.parametrize("op", ["write", "read"])
def test_cpu_tier(benchmark: BenchmarkFixture, op: str) -> None:
    _roundtrip(CPUTier(block_bytes=BLOCK, capacity_blocks=BATCH, pin_memory=False), benchmark, op)


@pytest.mark.benchmark(group="tier-cpu")
def test_cpu_copy_baseline(benchmark: BenchmarkFixture) -> None:
    src, dst = blocks(), torch.empty((BATCH, BLOCK), dtype=torch.uint8)
    benchmark(dst.copy_, src)


@pytest.mark.benchmark(group="tier-gpu")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("op", ["write", "read"])
def test_gpu_tier(benchmark: BenchmarkFixture, op: str) -> None:
    from tiercache.tiers.gpu import GPUTier

    tier = GPUTier(block_bytes=BLOCK, capacity_blocks=BATCH, device="cuda:0")

    def synced(fn):
        def run(*a):
            fn(*a)
            torch.cuda.synchronize()

        return run

    tier.write, tier.read = synced(tier.write), synced(tier.read)  # time the copies themselves
    _roundtrip(tier, benchmark, op)


@pytest.mark.benchmark(group="tier-nvme")
@pytest.mark.parametrize("op", ["write", "read"])
def test_nvme_tier(benchmark: BenchmarkFixture, tmp_path, op: str) -> None:
    from tiercache.tiers.nvme import NVMeTier

    tier = NVMeTier(
        block_bytes=BLOCK, capacity_blocks=BATCH, path=str(tmp_path / "n"), fsync="never"
    )
    _roundtrip(tier, benchmark, op)


@pytest.mark.benchmark(group="tier-nvme")
@pytest.mark.parametrize("op", ["write", "read"])
def test_raw_odirect_baseline(benchmark: BenchmarkFixture, tmp_path, op: str) -> None:
    from tiercache.tiers.format import HEADER_SIZE
    from tiercache.tiers.nvme import ALIGN

    slot = -(-(HEADER_SIZE + BLOCK) // ALIGN) * ALIGN
    try:
        fd = os.open(tmp_path / "raw", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    os.posix_fallocate(fd, 0, slot * BATCH)
    buf = mmap.mmap(-1, slot)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(slot))
    for i in range(BATCH):  # real data: reads of never-written extents would cost nothing
        os.pwrite(fd, buf, i * slot)
    if op == "write":
        benchmark(lambda: [os.pwrite(fd, buf, i * slot) for i in range(BATCH)])
    else:
        benchmark(lambda: [os.preadv(fd, [buf], i * slot) for i in range(BATCH)])
    os.close(fd)


def _lmdb_tier(path, compression: str):
    from tiercache.tiers.lmdb import LMDBTier

    return LMDBTier(
        block_bytes=BLOCK,
        capacity_blocks=BATCH,
        path=str(path),
        compression=compression,
        sync="never",
    )


@pytest.mark.benchmark(group="tier-lmdb")
@pytest.mark.parametrize("op", ["write", "read"])
def test_lmdb_tier(benchmark: BenchmarkFixture, tmp_path, op: str) -> None:
    _roundtrip(_lmdb_tier(tmp_path / "l", "none"), benchmark, op)


@pytest.mark.benchmark(group="tier-lmdb")
@pytest.mark.parametrize("op", ["write", "read"])
def test_raw_lmdb_baseline(benchmark: BenchmarkFixture, tmp_path, op: str) -> None:
    from tiercache.benchharness.baselines import open_raw_lmdb, raw_lmdb_get, raw_lmdb_put
    from tiercache.tiers.lmdb import map_size_for

    env, db = open_raw_lmdb(str(tmp_path / "raw"), 4 * map_size_for(BATCH, BLOCK))
    ks, rows = keys(BATCH), blocks().numpy()
    out = np.empty_like(rows)

    def put() -> None:
        raw_lmdb_put(env, db, ks, rows)

    def get() -> None:
        raw_lmdb_get(env, db, ks, out)

    put()
    benchmark(put if op == "write" else get)
    env.close()


# -- compression -----------------------------------------------------------------------------
def bf16_like() -> torch.Tensor:
    """KV-like data: bf16 normals, as bytes (the sign/exponent bytes compress, mantissas not)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn((BATCH, BLOCK // 2), generator=g).to(torch.bfloat16)
    return x.view(torch.uint8).reshape(BATCH, BLOCK).contiguous()


@pytest.mark.benchmark(group="compression")
@pytest.mark.parametrize("compression", ["zstd", "none"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_lmdb_tier_compression(
    benchmark: BenchmarkFixture, tmp_path, compression: str, op: str
) -> None:
    tier = _lmdb_tier(tmp_path / "c", compression)
    ks, src = keys(BATCH), bf16_like()
    slots = tier.allocate(ks)
    dst = torch.empty_like(src)
    tier.write(slots, src, ks)
    if op == "write":
        benchmark(tier.write, slots, src, ks)
    else:
        benchmark(tier.read, slots, dst, ks)
        assert torch.equal(dst, src)
    stats = tier.stats()
    benchmark.extra_info["stats"] = {k: v for k, v in stats.items() if isinstance(v, int | float)}
    tier.close()


@pytest.mark.benchmark(group="compression")
def test_zstd_alone_baseline(benchmark: BenchmarkFixture) -> None:
    """zstandard level 1 on the same bytes, no shuffle, no store: the codec's own speed."""
    data = bf16_like().numpy().tobytes()
    c = zstandard.ZstdCompressor(level=1)
    out = benchmark(c.compress, data)
    benchmark.extra_info["ratio"] = len(data) / len(out)
