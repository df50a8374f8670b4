"""The worker with the copy handlers: round trips in every layout, ordering, failures, wait,
results exactly once, no thread left behind. CPU tensors stand in for the GPU buffer; the
same bodies run on CUDA when it is present."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tests.test_transfer_common import (
    DEVICES,
    LAYOUTS,
    K,
    SlowCopyHandler,
    assert_blocks,
    drain,
    make_kv,
    new_threads,
    register_pairs,
    snapshot,
)
from tiercache.tiers.cpu import CPUTier
from tiercache.transfer import (
    ENGINE_MEDIUM,
    GPULoadStoreSpec,
    KVLayout,
    OffloadingWorker,
    TierLoadStoreSpec,
    build_worker,
)

NB = 24


def tier_spec(slots, medium="cpu", tier=0) -> TierLoadStoreSpec:
    return TierLoadStoreSpec(tier, medium, slots, [K(s) for s in slots])


def setup(kind: str, device: str, factor: int, capacity: int = 8):
    caches, kv_first = make_kv(kind, NB, device=device)
    layout = KVLayout(caches, NB, factor)
    tier = CPUTier(block_bytes=layout.block_bytes, capacity_blocks=capacity)
    return caches, kv_first, layout, tier


def slow_worker(layout, tier, **kw) -> OffloadingWorker:
    worker = OffloadingWorker()
    h = SlowCopyHandler(layout, [tier], **kw)
    register_pairs(worker, h, [(ENGINE_MEDIUM, tier.medium), (tier.medium, ENGINE_MEDIUM)])
    return worker


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_round_trip_into_other_blocks(kind: str, factor: int, device: str) -> None:
    caches, kv_first, layout, tier = setup(kind, device, factor)
    rng = random.Random(f"{kind}{factor}")
    ids = rng.sample(range(NB), 2 * 4 * factor)
    src_ids, dst_ids = ids[: 4 * factor], ids[4 * factor :]
    slots = [5, 1, 2, 6]  # neither sorted nor one run: the batched index paths
    want = snapshot(caches, kv_first, src_ids)
    with build_worker(layout, [tier]) as worker:
        # Store engine blocks -> tier slots, then load them back into different engine blocks.
        assert worker.transfer_async(1, (GPULoadStoreSpec(src_ids), tier_spec(slots)))
        assert worker.transfer_async(2, (tier_spec(slots), GPULoadStoreSpec(dst_ids)))
        res = drain(worker, [1, 2])
    assert all(r.success and r.failed == () for r in res.values())
    assert res[1].transfer_size == res[2].transfer_size == 4 * layout.block_bytes
    assert res[1].transfer_type == (ENGINE_MEDIUM, "cpu")
    assert res[2].transfer_type == ("cpu", ENGINE_MEDIUM)
    assert_blocks(caches, kv_first, dst_ids, want)
    # The tier row holds the engine-block records back to back (the documented format).
    if kind == "cross_layer" and device == "cpu":
        row = tier.pool[slots[0]].view(factor, -1)
        for j in range(factor):
            blk = torch.cat([t.reshape(-1).view(torch.uint8) for t in want[j]])
            assert torch.equal(row[j], blk)


@pytest.mark.parametrize("device", DEVICES)
def test_contiguous_and_large_batches(device: str) -> None:
    # Runs of slots and blocks (slice copies) and a batch larger than the few-runs threshold.
    caches, kv_first, layout, tier = setup("separate", device, 1, capacity=20)
    src_ids, dst_ids = list(range(0, 10)), list(range(12, 22))
    want = snapshot(caches, kv_first, src_ids)
    with build_worker(layout, [tier]) as worker:
        worker.transfer_async(1, (GPULoadStoreSpec(src_ids), tier_spec(list(range(10)))))
        worker.transfer_async(2, (tier_spec(list(range(10))), GPULoadStoreSpec(dst_ids)))
        assert all(r.success for r in drain(worker, [1, 2]).values())
    assert_blocks(caches, kv_first, dst_ids, want)


# -- ordering ------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_load_after_store_sees_stored_bytes_without_waiting(device: str) -> None:
    caches, kv_first, layout, tier = setup("kv_separate", device, 1)
    a, b, c, d = [0, 1], [2, 3], [4, 5], [6, 7]
    want_a, want_c = snapshot(caches, kv_first, a), snapshot(caches, kv_first, c)
    # Stores sleep 50 ms before copying; without ordering every load would run first.
    worker = slow_worker(layout, tier, store_delay=0.05)
    try:
        worker.transfer_async(1, (GPULoadStoreSpec(a), tier_spec([3, 4])))  # A -> slots
        worker.transfer_async(2, (tier_spec([3, 4]), GPULoadStoreSpec(b)))  # slots -> B
        worker.transfer_async(3, (GPULoadStoreSpec(c), tier_spec([3, 4])))  # C overwrites
        worker.transfer_async(4, (tier_spec([3, 4]), GPULoadStoreSpec(d)))  # slots -> D
        res = drain(worker, [1, 2, 3, 4])
    finally:
        worker.close()
    assert all(r.success for r in res.values())
    assert_blocks(caches, kv_first, b, want_a)  # read after write: sees A
    assert_blocks(caches, kv_first, d, want_c)  # write after read: the overwrite waited for 2


def test_many_concurrent_jobs_chain_through_one_slot() -> None:
    # 30 store/load pairs through the same two slots, submitted at once: each load must see
    # its own store's bytes, so every pair is ordered after the previous one.
    caches, kv_first, layout, tier = setup("cross_layer", "cpu", 1)
    nb = NB
    pairs = [(i % (nb // 2), nb // 2 + (i % (nb // 2))) for i in range(30)]
    worker = slow_worker(layout, tier, store_delay=0.001)
    try:
        jid = 0
        expect = {}
        for src, dst in pairs:
            src_bytes = snapshot(caches, kv_first, [src])
            worker.transfer_async(jid, (GPULoadStoreSpec([src]), tier_spec([7])))
            worker.transfer_async(jid + 1, (tier_spec([7]), GPULoadStoreSpec([dst])))
            expect[dst] = src_bytes
            jid += 2
        res = drain(worker, list(range(jid)))
    finally:
        worker.close()
    assert len(res) == 60 and all(r.success for r in res.values())
    for dst, want in expect.items():
        assert_blocks(caches, kv_first, [dst], want)


def test_independent_jobs_are_not_serialised_across_directions() -> None:
    # A load of other slots does not wait for a slow store: the directions overlap.
    _caches, _kv_first, layout, tier = setup("separate", "cpu", 1)
    gate = {1: threading.Event()}
    worker = slow_worker(layout, tier, gate=gate)
    try:
        worker.transfer_async(1, (GPULoadStoreSpec([0]), tier_spec([0])))  # held at the gate
        worker.transfer_async(2, (tier_spec([5]), GPULoadStoreSpec([9])))
        worker.wait([2])
        got = worker.get_finished()
        assert [r.job_id for r in got] == [2]
        gate[1].set()
        drain(worker, [1])
    finally:
        gate[1].set()
        worker.close()


def test_expedited_load_does_not_queue_behind_regular_loads() -> None:
    # Two regular loads queue on the load lane (the first held at the gate); an expedited load
    # of other slots finishes before either, on its own lane. One that reads what a queued
    # store writes still waits for that store (ordering beats priority).
    caches, kv_first, layout, tier = setup("separate", "cpu", 1)
    gate = {1: threading.Event(), 5: threading.Event()}
    worker = slow_worker(layout, tier, gate=gate)
    try:
        worker.transfer_async(1, (tier_spec([0]), GPULoadStoreSpec([10])))  # held at the gate
        worker.transfer_async(2, (tier_spec([1]), GPULoadStoreSpec([11])))
        worker.transfer_async(3, (tier_spec([2]), GPULoadStoreSpec([12])), expedited=True)
        worker.wait([3])
        assert [r.job_id for r in worker.get_finished()] == [3]
        want = snapshot(caches, kv_first, [4])
        worker.transfer_async(5, (GPULoadStoreSpec([4]), tier_spec([6])))  # held at the gate
        worker.transfer_async(6, (tier_spec([6]), GPULoadStoreSpec([13])), expedited=True)
        assert not worker._jobs[6][0].issued.wait(0.2)  # follows store 5
        gate[5].set()
        assert drain(worker, [5, 6])[6].success
        assert_blocks(caches, kv_first, [13], want)
        gate[1].set()
        drain(worker, [1, 2])
    finally:
        for g in gate.values():
            g.set()
        worker.close()
    assert not any(t.name.endswith("-expedited") and t.is_alive() for t in threading.enumerate())


# -- failures ------------------------------------------------------------------------------
def test_failing_handler_reports_failure_and_dependents_fail() -> None:
    caches, kv_first, layout, tier = setup("separate", "cpu", 1)
    before = snapshot(caches, kv_first, [10, 11])
    worker = slow_worker(layout, tier, fail_jobs=[1])
    try:
        worker.transfer_async(1, (GPULoadStoreSpec([0, 1]), tier_spec([0, 1])))  # raises
        worker.transfer_async(2, (tier_spec([0, 1]), GPULoadStoreSpec([10, 11])))  # reads it
        worker.transfer_async(3, (GPULoadStoreSpec([2]), tier_spec([2])))  # unrelated
        res = drain(worker, [1, 2, 3])
    finally:
        worker.close()
    assert not res[1].success and res[1].failed == (0, 1) and res[1].transfer_size == 0
    # The load read slots whose bytes never arrived: it fails and never touches the engine.
    assert not res[2].success and res[2].failed == (0, 1)
    assert_blocks(caches, kv_first, [10, 11], before)
    assert res[3].success


def test_failing_load_is_not_reported_loaded() -> None:
    _caches, _kv_first, layout, tier = setup("separate", "cpu", 1)
    worker = slow_worker(layout, tier, fail_jobs=[2])
    try:
        worker.transfer_async(1, (GPULoadStoreSpec([0]), tier_spec([0])))
        worker.transfer_async(2, (tier_spec([0]), GPULoadStoreSpec([10])))
        res = drain(worker, [1, 2])
    finally:
        worker.close()
    assert res[1].success and not res[2].success and res[2].transfer_size == 0


def test_tier_closed_under_a_queued_job_fails_that_job_only() -> None:
    _caches, _kv_first, layout, tier = setup("separate", "cpu", 1)
    gate = {1: threading.Event()}
    worker = slow_worker(layout, tier, gate=gate)
    try:
        worker.transfer_async(1, (GPULoadStoreSpec([0]), tier_spec([0])))  # held at the gate
        tier.close()  # its pool is gone: the copy raises on the lane thread
        gate[1].set()
        assert not drain(worker, [1])[1].success
        # A closed tier is refused at submission; the worker itself keeps working.
        with pytest.raises(ValueError, match="contiguous uint8"):
            worker.transfer_async(2, (GPULoadStoreSpec([0]), tier_spec([0])))
        assert worker.in_flight == 0
    finally:
        gate[1].set()
        worker.close()


# -- API contract --------------------------------------------------------------------------
def test_unknown_pair_malformed_and_duplicate_jobs() -> None:
    _caches, _kv_first, layout, tier = setup("separate", "cpu", 2)
    with build_worker(layout, [tier]) as worker:
        # No handler for the pair: False, nothing recorded.
        assert not worker.transfer_async(1, (GPULoadStoreSpec([0, 1]), tier_spec([0], "nvme")))
        # Wrong engine block count for factor 2, wrong medium for the tier index: ValueError.
        with pytest.raises(ValueError, match="engine blocks"):
            worker.transfer_async(2, (GPULoadStoreSpec([0]), tier_spec([0])))
        with pytest.raises(ValueError, match="tier 3"):
            worker.transfer_async(2, (GPULoadStoreSpec([0, 1]), tier_spec([0], tier=3)))
        assert worker.in_flight == 0
        assert worker.transfer_async(7, (GPULoadStoreSpec([0, 1]), tier_spec([0])))
        with pytest.raises(ValueError, match="still in flight"):
            worker.transfer_async(7, (GPULoadStoreSpec([2, 3]), tier_spec([1])))
        assert drain(worker, [7])[7].success
        with pytest.raises(ValueError, match="already registered"):
            worker.register_handler(ENGINE_MEDIUM, "cpu", worker.handlers[(ENGINE_MEDIUM, "cpu")])
    with pytest.raises(RuntimeError, match="closed"):
        worker.transfer_async(8, (GPULoadStoreSpec([0, 1]), tier_spec([0])))


def test_wait_subset_and_each_result_once() -> None:
    _caches, _kv_first, layout, tier = setup("separate", "cpu", 1)
    gate = {3: threading.Event()}
    worker = slow_worker(layout, tier, gate=gate)
    try:
        worker.transfer_async(1, (GPULoadStoreSpec([0]), tier_spec([0])))
        worker.transfer_async(2, (GPULoadStoreSpec([1]), tier_spec([1])))
        worker.transfer_async(3, (tier_spec([5]), GPULoadStoreSpec([9])))  # held
        worker.wait([1, 2])
        assert not worker._jobs[3][0].done()  # wait returned while job 3 is still held
        got = sorted(r.job_id for r in worker.get_finished())
        assert got == [1, 2]
        assert worker.get_finished() == []  # never twice
        worker.wait([1, 2, 99])  # reported or unknown ids: nothing to wait for
        gate[3].set()
        worker.wait([3])
        assert [r.job_id for r in worker.get_finished()] == [3]
        assert worker.get_finished() == [] and worker.in_flight == 0
    finally:
        gate[3].set()
        worker.close()


def test_no_thread_left_behind() -> None:
    assert not new_threads()
    _caches, _kv_first, layout, tier = setup("separate", "cpu", 1)
    worker = build_worker(layout, [tier])
    h = SlowCopyHandler(layout, [tier])
    worker.register_handler("cpu", "cpu", h)  # a second handler, closed by the worker too
    assert len(new_threads()) == 4
    worker.transfer_async(1, (GPULoadStoreSpec([0]), tier_spec([0])))
    worker.close()
    worker.close()  # idempotent
    assert not new_threads()
    # Jobs queued before close still ran and are still reported.
    assert [r.job_id for r in worker.get_finished()] == [1]


def test_stats_recorded_per_type() -> None:
    _caches, _kv_first, layout, tier = setup("separate", "cpu", 1)
    with build_worker(layout, [tier]) as worker:
        worker.transfer_async(1, (GPULoadStoreSpec([0, 1]), tier_spec([0, 1])))
        worker.transfer_async(2, (tier_spec([0]), GPULoadStoreSpec([5])))
        drain(worker, [1, 2])
        stats = worker.take_stats()
        assert worker.take_stats() is None
    red = stats.reduce()
    assert red[f"{ENGINE_MEDIUM}_to_cpu_total_bytes"] == 2 * layout.block_bytes
    assert red[f"cpu_to_{ENGINE_MEDIUM}_total_bytes"] == layout.block_bytes
    assert red[f"{ENGINE_MEDIUM}_to_cpu_total_time"] > 0


# -- CUDA specifics ------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_store_waits_for_compute_stream() -> None:
    # The model writes block 0 on the compute stream (after a long sleep kernel); the store
    # submitted right after must copy what it wrote, not what was there before.
    caches, _kv_first, layout, tier = setup("kv_separate", "cuda", 1)
    with build_worker(layout, [tier]) as worker:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        for t in caches.values():
            t[:, 0].view(torch.int16).fill_(1234)
        worker.transfer_async(1, (GPULoadStoreSpec([0]), tier_spec([2])))
        worker.transfer_async(2, (tier_spec([2]), GPULoadStoreSpec([5])))
        res = drain(worker, [1, 2])
        assert res[1].success and res[2].success and res[1].transfer_time > 0
    for t in caches.values():
        assert bool((t[:, 5].view(torch.int16) == 1234).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_recycled_marks_and_timers_keep_every_round_ordered_and_timed() -> None:
    # The handler reuses its compute marks and timing start events: round after round, a
    # store submitted behind a long kernel still copies what the model wrote last (round i's
    # value), jobs in flight together each keep their own mark, and every job is timed.
    caches, _kv_first, layout, tier = setup("kv_separate", "cuda", 1)
    with build_worker(layout, [tier]) as worker:
        job = 0
        for i in range(1, 9):
            torch.cuda._sleep(20_000_000)
            for t in caches.values():
                t[:, i].view(torch.int16).fill_(100 + i)
            ids = []
            for slot in (i % 8, (i + 4) % 8):  # two stores in flight at once, then a load
                worker.transfer_async(job, (GPULoadStoreSpec([i]), tier_spec([slot])))
                ids.append(job)
                job += 1
            worker.transfer_async(job, (tier_spec([i % 8]), GPULoadStoreSpec([12 + i])))
            ids.append(job)
            job += 1
            res = drain(worker, ids)
            assert all(r.success and r.transfer_time > 0 for r in res.values()), i
            for t in caches.values():
                assert bool((t[:, 12 + i].view(torch.int16) == 100 + i).all()), i


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gpu_tier_same_device() -> None:
    from tiercache.tiers.gpu import GPUTier

    caches, kv_first = make_kv("cross_layer", NB, device="cuda")
    layout = KVLayout(caches, NB, 2)
    tier = GPUTier(block_bytes=layout.block_bytes, capacity_blocks=8, device="cuda")
    want = snapshot(caches, kv_first, [3, 9, 1, 4])
    with build_worker(layout, [tier]) as worker:
        spec = TierLoadStoreSpec(0, "gpu", [6, 2], [K(6), K(2)])
        worker.transfer_async(1, (GPULoadStoreSpec([3, 9, 1, 4]), spec))
        worker.transfer_async(2, (spec, GPULoadStoreSpec([20, 21, 22, 23])))
        assert all(r.success for r in drain(worker, [1, 2]).values())
    assert_blocks(caches, kv_first, [20, 21, 22, 23], want)


def test_build_worker_wiring_and_validation() -> None:
    from tests.test_transfer_common import DictTier

    _caches, _kv_first, layout, tier = setup("separate", "cpu", 1)
    disk = DictTier(name="disk", block_bytes=layout.block_bytes, capacity_blocks=4)
    with build_worker(layout, [tier, disk]) as worker:
        h = worker.handlers
        # Pool tiers get the copy handler; the rest and every tier pair the disk handler.
        assert type(h[(ENGINE_MEDIUM, "cpu")]).__name__ == "CPUCopyHandler"
        assert h[("cpu", ENGINE_MEDIUM)] is h[(ENGINE_MEDIUM, "cpu")]
        assert type(h[(ENGINE_MEDIUM, "disk")]).__name__ == "DiskHandler"
        assert h[("cpu", "disk")] is h[("disk", "cpu")] is h[(ENGINE_MEDIUM, "disk")]
    with pytest.raises(ValueError, match="distinct"):
        build_worker(layout, [tier, tier])
    with pytest.raises(ValueError, match="names the engine"):
        build_worker(
            layout, [CPUTier(name=ENGINE_MEDIUM, block_bytes=layout.block_bytes, capacity_blocks=2)]
        )
    with pytest.raises(ValueError, match="offloaded block"):
        build_worker(layout, [CPUTier(block_bytes=layout.block_bytes * 2, capacity_blocks=2)])
    assert not new_threads()


# -- stream order between the pool's own copies and the worker's streams ------------------
class _FakeEvent:
    def __init__(self, log: list[str], name: str) -> None:
        self.name = name
        log.append(f"record {name}")


class _FakeStream:
    """Stands in for a CUDA stream: logs what is recorded on it and what it waits for."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.n = log, name, 0

    def record_event(self) -> _FakeEvent:
        self.n += 1
        return _FakeEvent(self.log, f"{self.name}#{self.n}")

    def wait_event(self, event: _FakeEvent) -> None:
        self.log.append(f"{self.name} waits {event.name}")


def test_pool_copies_fence_and_the_cuda_lane_waits_for_the_fence(monkeypatch) -> None:
    """The CPU twin runs the logic with the device's stream faked: a pool on an asynchronous
    device records a fence after each of its own copies, and the CUDA handler's lane stream
    waits for the compute stream and then for that fence before it copies."""
    from tiercache.transfer.cuda_handler import CUDACopyHandler
    from tiercache.transfer.job import Job

    log: list[str] = []
    default = _FakeStream(log, "default")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
    _caches, _kv_first, layout, tier = setup("separate", "cpu", 1)
    assert tier.fence is None  # on the CPU nothing is pending after a copy
    tier.write([1], torch.zeros((1, layout.block_bytes), dtype=torch.uint8))
    assert tier.fence is None and log == []
    tier._async = True  # the pool as it behaves on a CUDA device
    tier.write([1, 3], torch.ones((2, layout.block_bytes), dtype=torch.uint8))
    assert log == ["record default#1"] and tier.fence.name == "default#1"
    tier.read([3], torch.empty((1, layout.block_bytes), dtype=torch.uint8))
    assert tier.fence.name == "default#2"  # the last own copy is the one to wait for

    handler = CUDACopyHandler.__new__(CUDACopyHandler)  # no CUDA here: no real streams
    handler.layout, handler._tiers = layout, [tier]
    handler._streams = {"store": _FakeStream(log, "store"), "load": _FakeStream(log, "load")}
    handler._marks = []
    job = Job(1, tier_spec([3]), GPULoadStoreSpec([5]))
    mark = job.compute_event = _FakeEvent(log, "compute")
    log.clear()
    assert handler.wait_deps(job, "load")
    assert log == ["load waits compute", "load waits default#2"]
    # Once the wait is queued, the compute mark is free for the next job's submission.
    assert handler._marks == [mark] and job.compute_event is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_load_waits_for_a_facade_write_into_the_gpu_pool() -> None:
    # The facade writes into the GPU pool on the default stream behind a long sleep kernel;
    # a load job submitted from a side stream right after must still copy those bytes.
    from tiercache.tiers.gpu import GPUTier

    caches, kv_first = make_kv("cross_layer", NB, device="cuda")
    layout = KVLayout(caches, NB, 1)
    tier = GPUTier(block_bytes=layout.block_bytes, capacity_blocks=8, device="cuda")
    with build_worker(layout, [tier]) as worker:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        rows = torch.full((1, layout.block_bytes), 7, dtype=torch.uint8, device="cuda")
        tier.write([4], rows)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # the engine's current stream is not the pool's
            worker.transfer_async(
                1, (TierLoadStoreSpec(0, "gpu", [4], [K(4)]), GPULoadStoreSpec([2]))
            )
        assert drain(worker, [1])[1].success
    torch.cuda.synchronize()
    (block,) = snapshot(caches, kv_first, [2])
    assert all(bool((t.view(torch.uint8) == 7).all()) for t in block)
