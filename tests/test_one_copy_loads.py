"""One-copy loads (issue 35): an NVMe hit goes from the tier's aligned read buffer straight
into the engine's blocks (`Tier.read_to` -> `DiskHandler` -> `KVLayout.scatter` of strided
rows), verified first, under the job's fence. Real NVMe tiers in tmp dirs, real fp32 engine
tensors, the real transfer worker."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

import tiercache.tiers.nvme.tier as nvme_tier
from tests.test_transfer_common import K, drain
from tiercache.tiers.format import HEADER_SIZE, encode_block
from tiercache.tiers.lmdb import LMDBTier
from tiercache.tiers.nvme import NVMeTier
from tiercache.tiers.nvme.layout import SLAB
from tiercache.transfer import GPULoadStoreSpec, KVLayout, TierLoadStoreSpec, build_worker

NB = 48  # engine blocks
LAYERS, BS, HEADS, HD = 3, 4, 2, 16  # per layer and engine block: 2 x 4 x 2 x 16 fp32 = 1 KiB


def fp32_engine(seed: int = 0) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: per layer one fp32 tensor [2 (K, V), blocks, block size, heads, dim]."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer.{i}": torch.randn(2, NB, BS, HEADS, HD, generator=g, dtype=torch.float32)
        for i in range(LAYERS)
    }


def blocks(caches: dict[str, torch.Tensor], ids) -> list[torch.Tensor]:
    """The fp32 contents of engine blocks `ids`, every layer, K and V (copies)."""
    return [torch.stack([t[:, b] for t in caches.values()]).clone() for b in ids]


def nvme(tmp_path, bb: int, *, run_slots: int, monkeypatch, **kw) -> NVMeTier:
    """A real NVMe tier whose runs are at most `run_slots` slots (RUN_BYTES is read at open)."""
    slot = -(-(HEADER_SIZE + bb) // 4096) * 4096
    monkeypatch.setattr(nvme_tier, "RUN_BYTES", run_slots * slot)
    return NVMeTier(
        name="nvme", path=str(tmp_path / "nvme"), block_bytes=bb, capacity_blocks=24, **kw
    )


def spec(slots, keys) -> TierLoadStoreSpec:
    return TierLoadStoreSpec(0, "nvme", list(slots), list(keys))


def store(worker, caches, ids, slots, keys, factor: int, job_id: int = 1) -> None:
    eng = [b * factor + j for b in ids for j in range(factor)]
    worker.transfer_async(job_id, (GPULoadStoreSpec(eng), spec(slots, keys)))
    assert drain(worker, [job_id])[job_id].success


@pytest.mark.parametrize("factor", [1, 2])
def test_loads_land_exactly_the_stored_bytes_runs_gaps_and_duplicates(
    factor: int, tmp_path, monkeypatch
) -> None:
    caches = fp32_engine()
    layout = KVLayout(caches, NB, factor)
    tier = nvme(tmp_path, layout.block_bytes, run_slots=3, monkeypatch=monkeypatch)
    # Stored blocks 0..9 (offloaded, `factor` engine blocks each) into slots with gaps and
    # out of order, so a load's slots make runs of 1..3 slots, not in the job's order.
    slots = [0, 1, 2, 3, 5, 6, 9, 12, 13, 14]
    keys = [K(100 + i) for i in range(10)]
    src_ids = list(range(10))
    eng = [b * factor + j for b in src_ids for j in range(factor)]
    want = dict(zip(slots, zip(keys, blocks(caches, eng[::factor]), strict=True), strict=True))
    want_eng = blocks(caches, eng)
    # The staged path is not taken: the tier's `read` would copy into a staging tensor.
    monkeypatch.setattr(NVMeTier, "read", lambda *a, **k: pytest.fail("staged read"))
    worker = build_worker(layout, [tier])
    try:
        store(worker, caches, src_ids, slots, keys, factor)
        # Load in another order, slot 5 twice (two engine destinations), into blocks 12..22.
        order = [13, 5, 0, 1, 2, 14, 5, 9, 12, 6, 3]
        dst = list(range(12, 12 + len(order)))
        dst_eng = [b * factor + j for b in dst for j in range(factor)]
        ks = [want[s][0] for s in order]
        worker.transfer_async(2, (spec(order, ks), GPULoadStoreSpec(dst_eng)))
        res = drain(worker, [2])[2]
    finally:
        worker.close()
        tier.close()
    assert res.success and res.transfer_size == len(order) * layout.block_bytes
    got = blocks(caches, dst_eng)
    for n, s in enumerate(order):  # each engine block holds exactly what its slot stored
        i = slots.index(s)
        for j in range(factor):
            assert torch.equal(got[n * factor + j], want_eng[i * factor + j]), (s, j)


def test_a_corrupt_slot_fails_exactly_its_block_and_leaves_the_engine_block(
    tmp_path, monkeypatch
) -> None:
    caches = fp32_engine()
    layout = KVLayout(caches, NB)
    tier = nvme(tmp_path, layout.block_bytes, run_slots=4, monkeypatch=monkeypatch)
    slots, keys = list(range(8)), [K(i) for i in range(8)]
    worker = build_worker(layout, [tier])
    try:
        store(worker, caches, range(8), slots, keys, 1)
        tier.flush()
        # Flip one payload byte of slot 5 on disk (the middle of the second run).
        fd = os.open(os.path.join(tier.path, SLAB), os.O_RDWR)
        try:
            at = 5 * tier.slot_bytes + HEADER_SIZE + 100
            b = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([b[0] ^ 0x40]), at)
        finally:
            os.close(fd)
        dst = list(range(20, 28))
        before = blocks(caches, dst)
        want = blocks(caches, range(8))
        worker.transfer_async(2, (spec(slots, keys), GPULoadStoreSpec(dst)))
        res = drain(worker, [2])[2]
    finally:
        worker.close()
        tier.close()
    assert not res.success and res.failed == (5,)
    got = blocks(caches, dst)
    assert torch.equal(got[5], before[5])  # the corrupt block never reached the engine
    for i in (0, 1, 2, 3, 4, 6, 7):
        assert torch.equal(got[i], want[i]), i


def test_a_cancelled_load_writes_nothing_after_the_cancel(tmp_path, monkeypatch) -> None:
    caches = fp32_engine()
    layout = KVLayout(caches, NB)
    # One slot a run and one I/O thread: run r + 2 is read only after run r was handed over.
    tier = nvme(tmp_path, layout.block_bytes, run_slots=1, monkeypatch=monkeypatch, io_threads=1)
    slots, keys = list(range(10)), [K(i) for i in range(10)]
    worker = build_worker(layout, [tier])
    cancelled = threading.Event()
    writes: list[tuple[list[int], bool]] = []  # (engine block ids, whether after the cancel)
    scatter = layout.scatter

    def spy(ids, rows, **kw):
        writes.append((list(ids), cancelled.is_set()))
        scatter(ids, rows, **kw)

    try:
        store(worker, caches, range(10), slots, keys, 1)
        dst = list(range(30, 40))
        before = blocks(caches, dst)
        want = blocks(caches, range(10))
        real = os.preadv

        def preadv(fd, bufs, off):  # the engine gives up while slot 2 is being read
            if off == 2 * tier.slot_bytes and not cancelled.is_set():
                assert worker.cancel(2)
                cancelled.set()
            return real(fd, bufs, off)

        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(layout, "scatter", spy)
        worker.transfer_async(2, (spec(slots, keys), GPULoadStoreSpec(dst)))
        res = drain(worker, [2])[2]
    finally:
        worker.close()
        tier.close()
    assert cancelled.is_set() and not res.success
    assert not any(after for _, after in writes)  # no byte reached the engine after cancel
    landed = {b for ids, _ in writes for b in ids}
    assert 32 not in landed  # slot 2 was read after the cancel: never written
    assert set(res.failed) == {b - 30 for b in dst if b not in landed}
    got = blocks(caches, dst)
    for i, b in enumerate(dst):
        assert torch.equal(got[i], want[i] if b in landed else before[i]), b


def test_a_compressed_block_in_a_slot_is_decoded_and_handed_over(tmp_path, monkeypatch) -> None:
    # The tier writes raw blocks only, but reads what the format allows: a zstd record
    # (written here by hand, as another writer of the format could) loads as its raw bytes.
    caches = fp32_engine()
    layout = KVLayout(caches, NB)
    bb = layout.block_bytes
    tier = nvme(tmp_path, bb, run_slots=4, monkeypatch=monkeypatch)
    worker = build_worker(layout, [tier])
    try:
        keys = [K(i) for i in range(3)]
        store(worker, caches, range(3), [0, 1, 2], keys, 1)
        raw = np.zeros(bb, dtype=np.uint8)
        raw[::7] = 3  # compresses well
        seq = int(tier._seqs[1])
        header, stored = encode_block(keys[1], raw, namespace=tier._ns, seq=seq, compression="zstd")
        assert header[6] != 0 and len(stored) < bb  # a compressed record
        fd = os.open(os.path.join(tier.path, SLAB), os.O_RDWR)
        try:
            os.pwrite(fd, header + stored, 1 * tier.slot_bytes)
        finally:
            os.close(fd)
        want = blocks(caches, [0, 2])
        worker.transfer_async(2, (spec([0, 1, 2], keys), GPULoadStoreSpec([40, 41, 42])))
        res = drain(worker, [2])[2]
    finally:
        worker.close()
        tier.close()
    assert res.success
    got = blocks(caches, [40, 41, 42])
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[1])
    eng = torch.stack([t[:, 41].contiguous().view(torch.uint8).flatten() for t in caches.values()])
    assert torch.equal(eng.flatten(), torch.from_numpy(raw))


def test_a_staged_tier_loads_through_read_to_too(tmp_path) -> None:
    # LMDB (zstd on) keeps the staged path: `Tier.read_to` reads into the handler's staging
    # buffer, and the stretches of good rows are scattered from there.
    caches = fp32_engine()
    layout = KVLayout(caches, NB)
    lm = LMDBTier(
        name="nvme",
        path=str(tmp_path / "lmdb"),
        block_bytes=layout.block_bytes,
        capacity_blocks=16,
        compression="zstd",
        element_size=1,
    )
    for t in caches.values():  # blocks 1 and 3 compress (random fp32 would not)
        t[:, 1] = 0
        t[:, 3] = 1
    assert not lm.reads_in_place
    worker = build_worker(layout, [lm])
    try:
        keys = [K(i) for i in range(6)]
        store(worker, caches, range(6), range(6), keys, 1)
        want = blocks(caches, range(6))
        order = [4, 0, 0, 5, 1]
        worker.transfer_async(
            2, (spec(order, [keys[s] for s in order]), GPULoadStoreSpec(range(10, 15)))
        )
        res = drain(worker, [2])[2]
    finally:
        worker.close()
        lm.close()
    assert res.success
    got = blocks(caches, range(10, 15))
    for n, s in enumerate(order):
        assert torch.equal(got[n], want[s])
