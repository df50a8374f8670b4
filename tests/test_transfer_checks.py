"""The submission checks in their cheaper shapes (issue 34): a one-block job is refused exactly
as a larger one is, a pool's layout check is kept only for a pool that passed it, the specs
and results set their own fields, and both of a job's flags are set under one lock."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from tests.test_transfer_common import K, drain, make_kv
from tiercache.tiers.cpu import CPUTier
from tiercache.transfer import (
    GPULoadStoreSpec,
    KVLayout,
    OffloadingWorker,
    TierLoadStoreSpec,
    build_worker,
)
from tiercache.transfer.cpu_handler import CPUCopyHandler
from tiercache.transfer.job import Flag, set_flags
from tiercache.transfer.results import TransferResult

NB = 16
CAP = 8


def tier_spec(slots) -> TierLoadStoreSpec:
    return TierLoadStoreSpec(0, "cpu", slots, [K(abs(s)) for s in slots])


@pytest.fixture
def setup():
    caches, _ = make_kv("separate", NB)
    layout = KVLayout(caches, NB)
    tier = CPUTier(block_bytes=layout.block_bytes, capacity_blocks=CAP)
    with build_worker(layout, [tier]) as worker:
        yield worker, layout, tier


@pytest.mark.parametrize("slots", [[CAP], [-1], [0, CAP], [-1, 0], [3, 0, CAP + 5]])
def test_slots_outside_the_tier_are_refused_for_one_block_and_many(setup, slots) -> None:
    worker, _, _ = setup
    blocks = list(range(len(slots)))
    for spec in [
        (GPULoadStoreSpec(blocks), tier_spec(slots)),  # a store
        (tier_spec(slots), GPULoadStoreSpec(blocks)),  # a load
    ]:
        with pytest.raises(ValueError, match=rf"slots outside tier 'cpu' \(slots 0..{CAP - 1}\)"):
            worker.transfer_async(1, spec)
    assert worker.in_flight == 0


@pytest.mark.parametrize("blocks", [[NB], [-1], [0, NB], [-3, 2], [1, 2, NB + 9]])
def test_engine_blocks_outside_the_buffer_are_refused_for_one_block_and_many(setup, blocks) -> None:
    worker, _, _ = setup
    slots = list(range(len(blocks)))
    for spec in [
        (GPULoadStoreSpec(blocks), tier_spec(slots)),
        (tier_spec(slots), GPULoadStoreSpec(blocks)),
    ]:
        with pytest.raises(ValueError, match=rf"engine block ids outside 0..{NB - 1}"):
            worker.transfer_async(1, spec)
    assert worker.in_flight == 0


def test_edges_of_the_ranges_are_accepted_and_the_worker_keeps_working(setup) -> None:
    worker, _, _ = setup
    assert worker.transfer_async(1, (GPULoadStoreSpec([NB - 1]), tier_spec([CAP - 1])))
    assert worker.transfer_async(2, (tier_spec([0]), GPULoadStoreSpec([0])))
    assert worker.transfer_async(3, (GPULoadStoreSpec([0, NB - 1]), tier_spec([0, CAP - 1])))
    assert all(r.success for r in drain(worker, [1, 2, 3]).values())


def test_a_pool_that_fails_its_check_is_refused_every_time() -> None:
    caches, _ = make_kv("separate", NB)
    layout = KVLayout(caches, NB)
    # Rows of the wrong size: refused at every submission, never remembered as checked.
    tier = CPUTier(block_bytes=layout.block_bytes * 2, capacity_blocks=CAP)
    worker = OffloadingWorker()
    handler = CPUCopyHandler(layout, [tier])
    worker.register_handler("GPU", "cpu", handler)
    try:
        for job_id in (1, 2):
            with pytest.raises(ValueError, match=r"rows of \d+ bytes, but an offloaded block"):
                worker.transfer_async(job_id, (GPULoadStoreSpec([0]), tier_spec([0])))
        assert worker.in_flight == 0
    finally:
        worker.close()


def test_a_pool_checked_once_is_checked_afresh_after_its_tier_closes(setup) -> None:
    worker, _, tier = setup
    assert worker.transfer_async(1, (GPULoadStoreSpec([0]), tier_spec([0])))
    assert drain(worker, [1])[1].success
    tier.close()  # a new, empty pool tensor: not the one that passed
    for job_id in (2, 3):
        with pytest.raises(ValueError, match="contiguous uint8"):
            worker.transfer_async(job_id, (GPULoadStoreSpec([0]), tier_spec([0])))


def test_a_spec_that_is_not_one_names_its_type(setup) -> None:
    worker, _, _ = setup
    with pytest.raises(TypeError, match="got list"):
        worker.transfer_async(1, ([0], tier_spec([0])))
    with pytest.raises(TypeError, match="got tuple"):
        worker.transfer_async(1, (GPULoadStoreSpec([0]), (0,)))
    with pytest.raises(TypeError, match="got int"):  # the source is named first
        worker.transfer_async(1, (5, (0,)))
    assert worker.in_flight == 0


def test_specs_normalize_and_stay_frozen_records() -> None:
    g = GPULoadStoreSpec(block_ids=[np.int64(3), torch.tensor(4)])
    assert g.block_ids == (3, 4) and all(type(b) is int for b in g.block_ids)
    assert g == GPULoadStoreSpec((3, 4)) and hash(g) == hash(GPULoadStoreSpec([3, 4]))
    assert g.medium == "GPU"
    t = TierLoadStoreSpec(tier=1, medium="nvme", slots=[np.int32(7)], keys=[K(1)])
    assert t == TierLoadStoreSpec(1, "nvme", (7,), (K(1),))
    assert type(t.slots[0]) is int and t.keys == (K(1),)
    assert repr(t) == f"TierLoadStoreSpec(tier=1, medium='nvme', slots=(7,), keys=({K(1)!r},))"
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.slots = (1,)  # type: ignore[misc]
    with pytest.raises(ValueError, match="TierLoadStoreSpec: 2 slots but 1 keys"):
        TierLoadStoreSpec(0, "cpu", [1, 2], [K(1)])
    with pytest.raises(ValueError, match="invalid literal"):
        GPULoadStoreSpec(["x"])
    with pytest.raises(TypeError):
        TierLoadStoreSpec(0, "cpu", [1])  # type: ignore[call-arg]


def test_results_keep_their_defaults_and_equality() -> None:
    r = TransferResult(4, True, 10, 0.5, ("GPU", "cpu"))
    assert (r.failed, r.gone) == ((), ())
    assert r == TransferResult(
        job_id=4, success=True, transfer_size=10, transfer_time=0.5, transfer_type=("GPU", "cpu")
    )
    assert TransferResult(4, False, 0, 0.0, ("cpu", "GPU"), (0, 1), (1,)).gone == (1,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.success = False  # type: ignore[misc]


def test_set_flags_wakes_waiters_of_each_flag_and_leaves_set_ones_alone() -> None:
    first, second = Flag(), Flag()
    seen: list[bool] = []

    def waiter() -> None:
        second.wait()
        seen.append(first.is_set())  # set in order: the earlier flag is set already

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    waiting = threading.Thread(target=first.wait)
    waiting.start()
    set_flags(first, second)
    for t in [*threads, waiting]:
        t.join(timeout=10)
        assert not t.is_alive()
    assert seen == [True, True, True]
    set_flags(first, second)  # again: nothing changes, nothing raises
    assert first.wait(0) and second.wait(0)
