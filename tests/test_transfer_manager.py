"""The worker driven by the OffloadingManager's plans, as a connector would: store with
demotion moves, multi-tier loads, failures completed as misses; bytes checked end to end."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tests.test_transfer_common import (
    DictTier,
    K,
    SlowCopyHandler,
    SlowDiskHandler,
    assert_blocks,
    make_kv,
    new_threads,
    register_pairs,
    snapshot,
)
from tiercache.manager import OffloadingManager
from tiercache.policies import LRUPolicy
from tiercache.tiers.cpu import CPUTier
from tiercache.transfer import (
    ENGINE_MEDIUM,
    KVLayout,
    OffloadingWorker,
    TierLoadStoreSpec,
    TransferResult,
    load_transfers,
    store_transfers,
)

NB, F = 48, 2


@dataclass
class Adapter:
    """The connector's bookkeeping: job id -> (keys, is_store)."""

    manager: OffloadingManager
    worker: OffloadingWorker
    jobs: dict[int, tuple[tuple[bytes, ...], bool]] = field(default_factory=dict)
    next_id: int = 0
    load_failed: list[int] = field(default_factory=list)

    def submit(self, spec, keys, store: bool) -> int:
        jid, self.next_id = self.next_id, self.next_id + 1
        assert self.worker.transfer_async(jid, spec)
        self.jobs[jid] = (tuple(keys), store)
        return jid

    def store(self, keys, block_ids) -> None:
        plan = self.manager.prepare_store(keys)
        assert plan is not None
        for spec in store_transfers(plan, keys, block_ids, F):
            dst = spec[1]
            assert isinstance(dst, TierLoadStoreSpec)
            self.submit(spec, dst.keys, True)

    def load(self, keys, block_ids) -> None:
        for spec in load_transfers(self.manager.prepare_load(keys), block_ids, F):
            src = spec[0]
            assert isinstance(src, TierLoadStoreSpec)
            self.submit(spec, src.keys, False)

    def finish(self) -> list[TransferResult]:
        self.worker.wait(list(self.jobs))
        results = self.worker.get_finished()
        for r in results:
            keys, store = self.jobs.pop(r.job_id)
            bad = set(r.failed)
            if store:  # arrived blocks become visible; the others are freed
                self.manager.complete_store([k for i, k in enumerate(keys) if i not in bad])
                self.manager.complete_store([keys[i] for i in sorted(bad)], success=False)
            else:  # unpin in any case; a failed load is a miss the engine recomputes
                self.manager.complete_load(keys)
                if not r.success:
                    self.load_failed.append(r.job_id)
        assert not self.jobs
        return results


def build(slow_disk: bool = True, fail_jobs=()):
    caches, kv_first = make_kv("layers_outer", NB)
    layout = KVLayout(caches, NB, F)
    cpu = CPUTier(name="cpu", block_bytes=layout.block_bytes, capacity_blocks=4)
    disk = DictTier(name="disk", block_bytes=layout.block_bytes, capacity_blocks=16)
    manager = OffloadingManager([cpu, disk], [LRUPolicy(4), LRUPolicy(16)], promote=False)
    worker = OffloadingWorker()
    copy = SlowCopyHandler(layout, [cpu, disk], fail_jobs=fail_jobs)
    register_pairs(worker, copy, [(ENGINE_MEDIUM, "cpu"), ("cpu", ENGINE_MEDIUM)])
    # Demotions sleep 50 ms: a store that did not wait for them would overwrite their source.
    disk_h = SlowDiskHandler([cpu, disk], layout, delay=0.05 if slow_disk else 0.0)
    register_pairs(
        worker,
        disk_h,
        [("cpu", "disk"), ("disk", "cpu"), ("disk", ENGINE_MEDIUM), (ENGINE_MEDIUM, "disk")],
    )
    return caches, kv_first, manager, worker, disk


def test_store_with_demotions_then_load_from_both_tiers() -> None:
    caches, kv_first, manager, worker, _disk = build()
    ad = Adapter(manager, worker)
    keys_a, keys_b = [K(i) for i in range(4)], [K(10 + i) for i in range(4)]
    ids_a, ids_b = list(range(0, 8)), list(range(8, 16))
    want_a, want_b = snapshot(caches, kv_first, ids_a), snapshot(caches, kv_first, ids_b)
    try:
        # 1. A fills the cpu tier.
        ad.store(keys_a, ids_a)
        assert all(r.success for r in ad.finish())
        assert manager.lookup(keys_a) == 4
        # 2. B evicts A: the plan demotes A to disk, then writes B into A's old slots. All
        #    jobs are submitted at once; the store must wait for the (slow) moves to read.
        plan_moves_before = manager.stats()["disk"]["demoted_in"]
        ad.store(keys_b, ids_b)
        results = ad.finish()
        assert manager.stats()["disk"]["demoted_in"] - plan_moves_before == 4
        assert [r.transfer_type for r in results].count(("cpu", "disk")) >= 1
        assert all(r.success for r in results)
        assert manager.where(keys_a[0]) == [1] and manager.where(keys_b[0]) == [0]
        # 3. Scribble over the engine's copies so the bytes can only come from the tiers.
        for t in caches.values():
            t.view(torch.int16)[:, :16].fill_(-1)
        # 4. One chain over both tiers: B from cpu, A from disk, into fresh engine blocks.
        chain = keys_b + keys_a
        assert manager.lookup(chain) == 8
        dst = list(range(16, 32))
        ad.load(chain, dst)
        results = ad.finish()
        assert sorted(r.transfer_type for r in results) == [
            ("cpu", ENGINE_MEDIUM),
            ("disk", ENGINE_MEDIUM),
        ]
        assert all(r.success for r in results)
        assert_blocks(caches, kv_first, dst[:8], want_b)
        assert_blocks(caches, kv_first, dst[8:], want_a)
        assert manager.stats()["cpu"]["pinned_blocks"] == 0
    finally:
        worker.close()
    assert not new_threads()


def test_failed_disk_read_is_a_miss_not_a_load() -> None:
    caches, kv_first, manager, worker, disk = build(slow_disk=False)
    ad = Adapter(manager, worker)
    keys_a, keys_b = [K(i) for i in range(4)], [K(10 + i) for i in range(4)]
    try:
        ad.store(keys_a, list(range(0, 8)))
        ad.finish()
        ad.store(keys_b, list(range(8, 16)))  # demotes A to disk
        ad.finish()
        disk.bad_slots = {manager._levels[1].slots[keys_a[1]]}  # A1 is corrupt on disk
        before = snapshot(caches, kv_first, range(32, 40))
        ad.load(keys_a, list(range(32, 40)))
        (r,) = ad.finish()
        assert not r.success and r.failed == (1,)
        assert ad.load_failed == [r.job_id]
        # The bad block's engine blocks were not written; the pin was released.
        assert_blocks(caches, kv_first, [34, 35], before[2:4])
        assert manager.stats()["disk"]["pinned_blocks"] == 0
    finally:
        worker.close()


def test_failed_store_frees_its_slots() -> None:
    _caches, _kv_first, manager, worker, _disk = build(slow_disk=False, fail_jobs=[0])
    ad = Adapter(manager, worker)
    keys = [K(i) for i in range(2)]
    try:
        ad.store(keys, [0, 1, 2, 3])  # job 0: its copy raises on the lane thread
        (r,) = ad.finish()
        assert not r.success and r.failed == (0, 1)
        # Completed with success=False: invisible, slots free, and the keys can be stored again.
        assert manager.lookup(keys) == 0 and manager.tiers[0].used_blocks == 0
        ad.store(keys, [0, 1, 2, 3])
        assert all(r.success for r in ad.finish()) and manager.lookup(keys) == 2
    finally:
        worker.close()
