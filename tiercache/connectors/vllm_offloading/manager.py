"""The scheduler half of a `TierCacheOffloadingSpec`: `TierCacheSchedulerSide`. It translates
keys, specs and events, tracks the store plans riding in vLLM's jobs until vLLM completes them,
applies what the worker half reported through the bridge, and verifies a block held only in a
persistent tier before calling it a hit. See the package doc.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from tiercache.cache import TierCache
from tiercache.connectors.stores import SharedStore, release_store
from tiercache.connectors.vllm_offloading.bridge import bridge_of
from tiercache.connectors.vllm_offloading.specs import (
    MEMORY_KINDS,
    TierLoadSpec,
    TierStoreSpec,
    config_info,
    holding,
    log,
    offload_key_to_key,
)
from tiercache.errors import BlockCorruptError
from tiercache.records import PrepareStoreOutput as TierPlan

# Run a manager method under the shared store's lock (other threads may use the same cache).
_locked = holding(lambda self: self._store.lock)


class TierCacheSchedulerSide(OffloadingManager):
    """vLLM's `OffloadingManager` over tiercache's manager; translates keys, specs and events."""

    def __init__(self, store: SharedStore, *, enable_events: bool = False) -> None:
        cache = store.cache
        self._store = store
        self._cache = cache
        self._manager = cache.manager
        self._ns = cache.config.namespace
        self._bridge = bridge_of(store)
        self._events_on = enable_events
        self._tkey: dict[bytes, bytes] = {}  # OffloadKey -> tiercache key
        self._okey: dict[bytes, OffloadKey] = {}  # tiercache key -> OffloadKey
        # anchor -> stored keys of plans whose vLLM job has not completed, oldest first (the
        # anchor: the first stored key, or the first loaded key for a promotion).
        self._plans: dict[bytes, list[tuple[bytes, ...]]] = {}
        self._pending: set[bytes] = set()  # keys of stores and moves not completed yet
        self._detached: set[bytes] = set()  # stores and moves past their deadline, running
        self._persistent = [t.persistent for t in cache.tiers]
        self._checked: set[tuple[bytes, int]] = set()  # (key, tier) verified since stored
        self._scratch = torch.empty((1, cache.block_bytes), dtype=torch.uint8)
        self._reset_left: set[bytes] = set()  # in flight at reset_cache: see on_reset_flushed
        self._closed = False

    @property
    def cache(self) -> TierCache:
        """The `TierCache` this manager books for (stats, tests)."""
        return self._cache

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """vLLM >= 0.33: the lock every caller holds around manager calls: the shared store's
        (other threads may use the same cache). Reentrant: the methods take it themselves too
        (vLLM 0.32's callers hold nothing)."""
        return self._store.lock

    def config_info(self) -> Sequence[Mapping[str, str | int | float | bool]]:
        """vLLM >= 0.33: labels of ``vllm:kv_offload_config_info`` (names declared by
        `TierCacheOffloadingSpec.config_info_keys`)."""
        return [config_info(self._cache)]

    # -- keys ------------------------------------------------------------------------------
    def _key(self, okey: bytes) -> bytes:
        """The tiercache key of `okey` (remembered only for blocks held: see `_named`)."""
        k = self._tkey.get(okey)
        return offload_key_to_key(self._ns, okey) if k is None else k

    def _keys(self, okeys: Iterable[bytes]) -> list[bytes]:
        return [self._key(k) for k in okeys]

    def _named(self, okeys: Iterable[bytes]) -> list[bytes]:
        """`_keys`, remembering both directions for blocks being stored or loaded (events name
        them in vLLM's terms until they leave every tier: `_forget`); keys only looked up or
        touched are never remembered, so the maps stay as large as the store."""
        out = []
        tkey, okey = self._tkey, self._okey
        for o in okeys:
            k = tkey.get(o)
            if k is None:
                k = tkey[o] = offload_key_to_key(self._ns, o)
                okey[k] = OffloadKey(bytes(o))
            out.append(k)
        return out

    def _apply_worker_reports(self) -> None:
        if self._detached:  # copies vLLM no longer polls for: their end may be waiting
            self._bridge.collect()
        r = self._bridge.drain()
        if r is None:
            return
        for keys in r.detached:  # before vLLM completes their job (the worker reported first)
            self._detached.update(keys)
        for keys in r.failed:
            self._manager.complete_store(keys, success=False)
            self._store.count("offload_store_failures", len(keys))
        for keys in r.ended:
            self._manager.complete_store(keys, success=True)
        for keys in (*r.failed, *r.ended):
            self._detached.difference_update(keys)
            self._pending.difference_update(keys)
        for tier, n in r.errors:
            self._manager.record_error(tier, n)
        if r.load_failures:
            self._store.count("offload_load_failures", r.load_failures)

    # -- vLLM's OffloadingManager ----------------------------------------------------------
    @_locked
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._apply_worker_reports()
        k = self._key(key)
        # `leaving`: a block being written through is served from its source slot.
        n, moving = self._manager.lookup_ready((k,), leaving=True)
        if moving:  # being demoted between tiers: ready again once the move completes
            return LookupResult.HIT_PENDING
        if n and self._verify(k):
            self._store.count("offload_hits")
            return LookupResult.HIT
        if not n and self._manager.is_pending(k) and k not in self._detached:
            # Its store is in flight: vLLM asks again rather than recompute the block. Not a
            # store given up at its deadline, which may wait on a hung disk for ever.
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    @_locked
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TierLoadSpec:
        tkeys = self._named(keys)
        load = self._manager.prepare_load(tkeys, leaving=True)
        # vLLM's scheduler never calls `touch` (0.32, 0.33): the policies learn of reuse here,
        # before this request's store makes room, so it cannot evict the prefix it loads.
        self._manager.touch(tkeys)
        promote = None
        if any(load.tiers):
            # Hits below the first tier are copied up from the engine blocks they load into,
            # after the load, in the same job.
            promote = self._manager.prepare_promote(tkeys)
            if promote is not None and promote.keys_to_store:
                self._track_plan(promote, tkeys[0])
            else:
                promote = None
        return TierLoadSpec(load, promote)

    @_locked
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._manager.touch(self._keys(keys))

    @_locked
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._apply_worker_reports()
        tkeys = self._keys(keys)
        self._manager.complete_load(tkeys)
        for k in tkeys:  # vLLM passes a set: find the promotion's anchor among the keys
            self._complete_plan(k, True)

    @_locked
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self._apply_worker_reports()
        tkeys = self._named(keys)
        where = self._manager.where
        for k in tkeys:
            # A key held already is not stored again: a copy unverified in a persistent tier
            # (vLLM recomputed it) is checked now, so a corrupt one is replaced.
            if where(k):
                self._verify(k)
        plan = self._manager.prepare_store(tkeys)
        holds = self._manager.holds
        for o, k in zip(keys, tkeys, strict=True):  # placed nowhere: nothing to name later
            if not holds(k) and k not in self._pending:
                self._tkey.pop(o, None)
                self._okey.pop(k, None)
        if plan is None:
            return None
        # The stored keys in the call's order: vLLM lists the engine blocks of `keys_to_store`
        # in that order, whatever order it gets them back in.
        placed = set(plan.stored_keys)
        stored = tuple(k for k in tkeys if k in placed)
        if stored:
            self._track_plan(plan, plan.stored_keys[0])
        self._drop_events_if_unused()
        okey = self._okey
        return PrepareStoreOutput(
            keys_to_store=[okey[k] for k in stored],
            store_spec=TierStoreSpec(plan, stored),
            evicted_keys=[okey[k] for k in plan.evicted_keys if k in okey],
        )

    @_locked
    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self._apply_worker_reports()
        tkeys = self._keys(keys)
        for k in tkeys:
            self._complete_plan(k, success)
        self._store.count("offload_stored" if success else "offload_store_failures", len(tkeys))
        self._drop_events_if_unused()
        if success and tkeys:  # copy them down now, not at the write-through thread's next poll
            self._cache.wake_write_through()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()  # chunk level: blocks already offloaded are skipped

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Nothing is held per request: loads unpin in `complete_load`, stores complete in
        `complete_store` (which may still arrive after this call)."""

    @_locked
    def take_events(self) -> Iterable[OffloadingEvent]:
        self._apply_worker_reports()
        out: list[OffloadingEvent] = []
        tiers = self._cache.tiers
        index = {t.medium: i for i, t in enumerate(tiers)}
        for ev in self._manager.take_events():
            keys = [self._okey[k] for k in ev.keys if k in self._okey]
            if ev.removed:
                self._forget(ev.keys)
            if not keys:
                continue  # blocks recovered from a persistent tier before vLLM named them
            i = index[ev.medium]
            out.append(
                OffloadingEvent(
                    keys=keys,
                    medium=Medium.CPU if tiers[i].kind in MEMORY_KINDS else Medium.STORAGE,
                    removed=ev.removed,
                    # The first tier is the primary; lower tiers name themselves.
                    ownership=None if i == 0 else ev.medium,
                )
            )
        return out

    @_locked
    def reset_cache(self) -> None:
        """Drop every block this process has named from every tier. vLLM 0.33 may call this
        with jobs in flight (0.32 flushes them first): their blocks are dropped at
        `on_reset_flushed` (slots are never freed under a running copy)."""
        self._apply_worker_reports()
        self._reset_left = set()
        for k in list(self._okey):
            if k in self._pending or self._manager.is_pending(k):
                self._reset_left.add(k)
            elif self._manager.where(k):
                try:
                    self._manager.discard((k,))
                except ValueError:  # pinned by a load in flight
                    self._reset_left.add(k)

    @_locked
    def on_reset_flushed(self) -> None:
        """vLLM >= 0.33: every job in flight at the last `reset_cache` has been reported; drop
        the blocks that reset had to leave (stored or loaded meanwhile)."""
        self._apply_worker_reports()
        left, self._reset_left = self._reset_left, set()
        for k in left:
            if self._manager.where(k):
                with contextlib.suppress(ValueError):  # loaded again after the reset: kept
                    self._manager.discard((k,))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._store.lock:
            self._apply_worker_reports()
        release_store(self._store)

    def _track_plan(self, plan: TierPlan, anchor: bytes) -> None:
        """Remember a store or promotion plan until vLLM completes the job it rides in (named
        by `anchor`: the first stored key, or the first loaded key for a promotion)."""
        self._plans.setdefault(anchor, []).append(plan.stored_keys)
        self._pending.update(k for m in plan.moves for k in m.keys)
        self._pending.update(plan.stored_keys)

    def _complete_plan(self, anchor: bytes, success: bool) -> None:
        plans = self._plans.get(anchor)
        if not plans:
            return
        stored = plans.pop(0)
        if not plans:
            del self._plans[anchor]
        # Failed blocks were completed already; stores given up at their deadline still run:
        # completed when the worker reports them.
        if self._detached:
            stored = tuple(k for k in stored if k not in self._detached)
        self._manager.complete_store(stored, success=success)
        self._pending.difference_update(stored)

    def _verify(self, k: bytes) -> bool:
        """Whether ready block `k` can be served: one whose fastest copy is persistent is read
        and checked once, so that a corrupt block becomes a miss (dropped, counted) here, never
        a failed load, which vLLM's OffloadingConnector cannot recompute."""
        where = self._manager.where(k, leaving=True)
        while where:
            t = where[0]
            if not self._persistent[t] or (k, t) in self._checked:
                return True
            spec = self._manager.prepare_load((k,), leaving=True)
            try:
                failed = self._cache.tiers[t].read(spec.slots, self._scratch, (k,))
            except (OSError, BlockCorruptError) as exc:
                log.warning("verifying block %s in %s failed: %s", k.hex(), spec.mediums[t], exc)
                failed = [0]
            finally:
                self._manager.complete_load((k,))
            if not failed:
                self._checked.add((k, t))
                return True
            if self._cache.tiers[t].sort_failed((k,), failed)[1]:  # not gone: an error
                self._manager.record_error(t, 1)
                self._store.count("offload_verify_errors")
            try:
                self._manager.discard((k,), t)
            except ValueError:  # another request is loading it right now
                return False
            before, where = where, self._manager.where(k, leaving=True)
            if where == before:  # a leaving block (discard keeps it): a miss while it moves
                return False
        return False

    def _drop_events_if_unused(self) -> None:
        # vLLM drains take_events() only with KV events on; else the buffer would grow for ever.
        if not self._events_on:
            for ev in self._manager.take_events():
                if ev.removed:
                    self._forget(ev.keys)

    def _forget(self, keys: Iterable[bytes]) -> None:
        where = self._manager.where
        for k in keys:
            ready = where(k)
            if self._checked:
                for t in range(len(self._persistent)):
                    if t not in ready:
                        self._checked.discard((k, t))
            if not ready and k not in self._pending:
                okey = self._okey.pop(k, None)
                if okey is not None:
                    self._tkey.pop(okey, None)


TierCacheOffloadingManager = TierCacheSchedulerSide  # its name before issue 50
