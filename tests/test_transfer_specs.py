"""Specs from manager plans, the dependency tracker, and a property test: any sequence of
jobs submitted at once ends in the same bytes as running it one job at a time."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_transfer_common import DictTier, K, SlowCopyHandler, make_kv, register_pairs
from tiercache.records import BlockMove, LoadSpec, PrepareStoreOutput, StoreSpec
from tiercache.tiers.cpu import CPUTier
from tiercache.transfer import (
    ENGINE_MEDIUM,
    DiskHandler,
    GPULoadStoreSpec,
    KVLayout,
    OffloadingWorker,
    TierLoadStoreSpec,
    load_transfers,
    store_transfers,
)
from tiercache.transfer.job import Job
from tiercache.transfer.ordering import DependencyTracker


def test_load_transfers_one_per_tier_with_factor() -> None:
    spec = LoadSpec(
        keys=(K(0), K(1), K(2)), tiers=(0, 1, 0), slots=(7, 3, 9), mediums=("cpu", "nvme")
    )
    out = load_transfers(spec, [10, 11, 20, 21, 30, 31], 2)
    assert out == [
        (TierLoadStoreSpec(0, "cpu", (7, 9), (K(0), K(2))), GPULoadStoreSpec([10, 11, 30, 31])),
        (TierLoadStoreSpec(1, "nvme", (3,), (K(1),)), GPULoadStoreSpec([20, 21])),
    ]
    with pytest.raises(ValueError, match="block_ids"):
        load_transfers(spec, [1, 2, 3], 2)


def test_store_transfers_moves_first_and_only_new_keys() -> None:
    move = BlockMove((K(9),), StoreSpec(0, "cpu", (4,)), StoreSpec(1, "nvme", (2,)))
    plan = PrepareStoreOutput((K(1),), StoreSpec(0, "cpu", (4,)), (K(9),), (move,))
    out = store_transfers(plan, [K(0), K(1)], [5, 6], 1)
    assert out == [
        (TierLoadStoreSpec(0, "cpu", (4,), (K(9),)), TierLoadStoreSpec(1, "nvme", (2,), (K(9),))),
        (GPULoadStoreSpec([6]), TierLoadStoreSpec(0, "cpu", (4,), (K(1),))),
    ]
    with pytest.raises(ValueError, match="every key"):
        store_transfers(plan, [K(0), K(2)], [5, 6], 1)
    with pytest.raises(ValueError, match="slots but"):
        TierLoadStoreSpec(0, "cpu", (1, 2), (K(1),))


def test_tracker_read_after_write_write_after_read_and_release() -> None:
    tr = DependencyTracker()

    def job(i, src, dst) -> Job:
        j = Job(i, src, dst)
        j.deps = tr.dependencies(j)
        tr.record(j)
        return j

    slot = TierLoadStoreSpec(0, "cpu", (3,), (K(3),))
    store = job(1, GPULoadStoreSpec([0]), slot)
    load = job(2, slot, GPULoadStoreSpec([5]))
    over = job(3, GPULoadStoreSpec([1]), slot)
    other = job(4, GPULoadStoreSpec([2]), TierLoadStoreSpec(0, "cpu", (4,), (K(4),)))
    assert store.deps == []
    assert load.deps == [(store, True)]  # reads what the store writes: fails with it
    # Overwrites what the store wrote (after it) and what the load reads (after its reads).
    assert {(j.job_id, r) for j, r in over.deps} == {(1, False), (2, None)}
    assert other.deps == []
    for j in (store, load, over, other):
        tr.release(j)
    assert len(tr) == 0


def test_tracker_overwrites_a_durable_slot_only_after_its_move_ends() -> None:
    """A demotion's source in a persistent tier (index 0 here) holds the block's only durable
    copy until the move's destination write ends: the store into that slot follows the whole
    move (False), not just its read (None) as in a volatile tier."""
    for durable, wait in (((0,), False), ((), None)):
        tr = DependencyTracker(durable)
        src = TierLoadStoreSpec(0, "nvme", (3,), (K(3),))
        move = Job(1, src, TierLoadStoreSpec(1, "lmdb", (8,), (K(3),)))
        move.deps = tr.dependencies(move)
        tr.record(move)
        store = Job(2, GPULoadStoreSpec([0]), TierLoadStoreSpec(0, "nvme", (3,), (K(4),)))
        assert tr.dependencies(store) == [(move, wait)]


# -- property: concurrent execution == sequential execution ---------------------------------
NB, CAP = 12, 6
OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "load", "move", "unmove", "dstore", "dload"]),
        st.lists(st.integers(0, NB - 1), min_size=1, max_size=3, unique=True),
        st.lists(st.integers(0, CAP - 1), min_size=3, max_size=3, unique=True),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, kind=st.sampled_from(["separate", "kv_shared"]))
def test_concurrent_jobs_match_sequential_model(ops, kind) -> None:
    caches, _ = make_kv(kind, NB, layers=2)
    layout = KVLayout(caches, NB)
    cpu = CPUTier(block_bytes=layout.block_bytes, capacity_blocks=CAP)
    disk = DictTier(block_bytes=layout.block_bytes, capacity_blocks=CAP)
    rows = torch.empty((NB, layout.block_bytes), dtype=torch.uint8)
    layout.gather(range(NB), rows)
    cpu.pool.copy_(rows[:CAP])
    disk.write(range(CAP), rows[NB - CAP :].clone(), [K(s) for s in range(CAP)])
    # The model: the same bytes, one job at a time, in submission order.
    m_eng, m_cpu = rows.clone(), cpu.pool.clone()
    m_disk = {s: disk.data[s][1].clone() for s in range(CAP)}
    worker = OffloadingWorker()
    copy = SlowCopyHandler(layout, [cpu, disk], store_delay=0.0005)
    register_pairs(worker, copy, [(ENGINE_MEDIUM, "cpu"), ("cpu", ENGINE_MEDIUM)])
    dh = DiskHandler([cpu, disk], layout, threads=2)
    register_pairs(
        worker,
        dh,
        [("cpu", "dict"), ("dict", "cpu"), (ENGINE_MEDIUM, "dict"), ("dict", ENGINE_MEDIUM)],
    )
    try:
        for i, (op, ids, slots3) in enumerate(ops):
            n = len(ids)
            slots = slots3[:n]
            t_cpu = TierLoadStoreSpec(0, "cpu", slots, [K(s) for s in slots])
            t_disk = TierLoadStoreSpec(1, "dict", slots, [K(s) for s in slots])
            eng = GPULoadStoreSpec(ids)
            spec = {
                "store": (eng, t_cpu),
                "load": (t_cpu, eng),
                "move": (t_cpu, t_disk),
                "unmove": (t_disk, t_cpu),
                "dstore": (eng, t_disk),
                "dload": (t_disk, eng),
            }[op]
            assert worker.transfer_async(i, spec)
            for d, s, b in zip(slots, slots, ids, strict=True):
                if op == "store":
                    m_cpu[d] = m_eng[b]
                elif op == "load":
                    m_eng[b] = m_cpu[s]
                elif op == "move":
                    m_disk[d] = m_cpu[s].clone()
                elif op == "unmove":
                    m_cpu[d] = m_disk[s]
                elif op == "dstore":
                    m_disk[d] = m_eng[b].clone()
                else:
                    m_eng[b] = m_disk[s]
        worker.wait(range(len(ops)))
        results = worker.get_finished()
    finally:
        worker.close()
    assert sorted(r.job_id for r in results) == list(range(len(ops)))
    assert all(r.success for r in results)
    got = torch.empty_like(rows)
    layout.gather(range(NB), got)
    assert torch.equal(got, m_eng)
    assert torch.equal(cpu.pool, m_cpu)
    assert all(torch.equal(disk.data[s][1], m_disk[s]) for s in range(CAP))
