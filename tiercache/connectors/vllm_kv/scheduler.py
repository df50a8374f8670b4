"""`KVScheduler`: the connector's scheduler role (keys and block ids, never bytes).

- Request state (`_Req`): each request's prefix keys (tiercache's own, deterministic across
  restarts; LoRA, cache salt and multimodal inputs as extra keys) and engine block ids.
- Matching (`get_num_new_matched_tokens`): a lookup from the first block vLLM has not
  computed, whole blocks only and never the block holding the last prompt token, through
  `LocalLookup` (local placement) or `RemoteIndex` (remote); hybrid models: `_match_groups`.
  The cost gate (`_affordable`) loads only the part of a hit cheaper to load than recompute.
- Planning (`update_state_after_alloc`, `build_connector_meta`): this step's loads, and the
  stores of the blocks this step completes (sliding windows: `_window_keep`).
- Events and finished stores (`update_connector_output`, `request_finished`, `take_events`).
- Head shards (`settings.shards`): requests and plans keep block keys and ids; lookups ask
  for every shard of every block (`HeadShards.all_keys`), a hit needing all of them; events
  for vLLM are block events again (`ShardEvents`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent

from tiercache.connectors.kv_groups import KVGroup, hit_end, window_positions
from tiercache.connectors.namespace import extra_keys_for
from tiercache.connectors.shard_events import ShardEvents
from tiercache.connectors.stores import SharedStore
from tiercache.connectors.vllm_kv.kv_events import EventTranslator, describe, placement_of
from tiercache.connectors.vllm_kv.local_lookup import LocalLookup
from tiercache.connectors.vllm_kv.messages import (
    Event,
    LoadJob,
    StoreJob,
    TierCacheConnectorMetadata,
    TierCacheHandshake,
    TierCacheWorkerMetadata,
)
from tiercache.connectors.vllm_kv.remote_index import RemoteIndex
from tiercache.connectors.vllm_kv.settings import KVSettings, RoleBase, log
from tiercache.connectors.vllm_kv.shared_blocks import SharedBlocks, open_shared_blocks
from tiercache.connectors.vllm_kv.storing import StoresInFlight
from tiercache.costs import LoadGate
from tiercache.hashing import group_keys, prefix_hashes
from tiercache.tiers import tier_class
from tiercache.tiers.base import StoreProbe

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# One DEBUG line per admission (prompt tokens, from the engine's cache, from tiercache), for
# serving benches to count reuse per request (bench/bench_serve.py enables it).
admissions = logging.getLogger("tiercache.connectors.vllm_kv.admissions")


@dataclass
class _Req:
    """Scheduler-side view of one request."""

    request: Request
    extra: dict[int, tuple[Any, ...]] | None
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # engine block ids, per group
    stored: int = 0  # leading blocks already handed to the worker for saving
    skip: bool = False  # prompt embeddings: token ids do not identify the KV, never cached
    hit: tuple[int, int] = (0, 0)  # (first block, number of blocks) of the last lookup
    local: int = 0  # tokens vLLM's own cache held at the last lookup (its num_computed_tokens)
    direct: bool = False  # the last hit is `LocalHit.direct`: loaded asynchronously
    sync: bool = False  # remote: the last hit is held in memory tiers, loaded synchronously
    # Hybrid models: keys per group, what the last hit loads as (group, block position, key),
    # and positions where a hit is likely to end (`_window_keep`).
    gkeys: dict[int, list[bytes]] = field(default_factory=dict)
    hit_plan: tuple[tuple[int, int, bytes], ...] = ()
    marks: set[int] = field(default_factory=set)


class KVScheduler(RoleBase):
    """The scheduler role over `settings`: lookups ask the `shared` cache (local placement) or,
    without it, the index of the workers' keys and `probes` (per rank, of its shared tiers)."""

    def __init__(
        self,
        settings: KVSettings,
        shared: SharedStore | None = None,
        probes: list[list[tuple[str, StoreProbe]]] | None = None,
    ) -> None:
        super().__init__(settings, shared)
        self._config = settings.config
        self._block_size = settings.block_size
        self._tp_size = settings.tp_size
        self._shards = settings.shards
        self._per = self._shards.shards if self._shards is not None else 1  # keys per block
        self._vllm_events = settings.events  # vLLM publishes KV events: build them
        self._shard_events = (
            ShardEvents(self._shards) if self._shards is not None and settings.events else None
        )
        self._groups, self._hma = settings.groups, settings.hma
        self.local = shared is not None
        self.remote = RemoteIndex(
            settings.tp_size, self._count, probes, settings.config.deadlines, self._shards
        )
        self.local_lookup = (
            LocalLookup(
                shared,
                settings.block_bytes,
                self._count,
                self._affordable,
                direct=settings.recompute_failures,
            )
            if shared is not None
            else None
        )
        # Remote placement with memory_loads "sync": tiers whose hits load before the step's
        # forward (memory: a copy of milliseconds), as the local placement's do; a disk's load
        # stays asynchronous.
        self._sync_mediums = frozenset(
            t.name
            for t in self._config.tiers
            if settings.sync_memory_loads and not tier_class(t.kind).persistent
        )
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self._pending: dict[str, int] = {}  # req id -> store plans not reported finished
        # Remote placement: a lookup that reaches a block still being stored asks again.
        self._storing = StoresInFlight(settings.config.deadlines.store_timeout)
        self._delayed: list[str] = []  # request_finished returned True; tell the worker
        self._events: list[Event] = []
        # vLLM's events (kv_events.py; not for hybrid models' per-group keys), and what every
        # engine on a shared store can load from it (shared_blocks.py).
        self._shared_blocks: SharedBlocks | None = None
        self._translator: EventTranslator | None = None
        if settings.events and not self._hma:
            self._shared_blocks = open_shared_blocks(
                self._config,
                settings.block_bytes,
                settings.hash_algo,
                interval_s=settings.events_poll_s,
                local=(shared.cache.tiers, shared.lock) if shared is not None else None,
                borrowed=probes[0] if probes else None,  # the remote index's (rank 0's)
                expand=self._shards.all_keys if self._shards is not None else None,
            )
            self._translator = EventTranslator(
                placement_of(self._config),
                limit=max(4096, 2 * settings.num_blocks),
                on_shared=self._shared_blocks.on_shared if self._shared_blocks else None,
            )
        # Cost-aware loading: over the shared cache's estimates (local) or the workers' samples.
        self._gate = LoadGate(
            self._config.loading, shared.cache.load_costs if shared is not None else None
        )

    def shutdown(self) -> None:
        """Stop probes and verifying reads, then `release` the store."""
        self.remote.shutdown()
        if self._shared_blocks is not None:
            self._shared_blocks.close()
        if self.local_lookup is not None:
            self.local_lookup.shutdown()
        self.release()

    def _lookup_local(self, keys: list[bytes], req_id: str = "") -> int | None:
        """The local placement's hit (LocalLookup), in blocks; None: vLLM asks again. The
        request's state records whether it is `direct` (loaded asynchronously)."""
        assert self.local_lookup is not None
        hit = self.local_lookup.lookup(keys, req_id)
        if hit is None:
            return None
        st = self._reqs.get(req_id)
        if st is not None:
            st.direct = hit.direct
        return hit.blocks

    def _state(self, request: Request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            mm = [
                (str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
                for f in (getattr(request, "mm_features", None) or [])
            ]
            extra = extra_keys_for(
                block_size=self._block_size,
                lora_name=getattr(getattr(request, "lora_request", None), "lora_name", None),
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
                namespace=self.settings.keys_namespace,
                extra_keys=st.extra,
            )
        return st.keys[:n_blocks]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        st.hit, st.direct, st.sync, st.local = (0, 0), False, False, num_computed_tokens
        bs = self._block_size
        # Never the block holding the last token: vLLM must compute at least one token.
        limit = (request.num_tokens - 1) // bs
        start = num_computed_tokens // bs
        if (
            limit <= start
            or st.skip
            or not self.settings.loads_on
            or getattr(request, "skip_reading_prefix_cache", False)
        ):
            return 0, False
        if self._hma:
            return self._match_groups(st, start, limit)
        keys = self._keys(st, limit)[start:]
        look = keys if self._shards is None else self._shards.all_keys(keys)
        self._expect(keys, look)
        if self._shared is None:
            n = self.remote.lookup(look, request.request_id)
        else:
            n = self._lookup_local(look, request.request_id)
        if n is None:  # a block is moving between tiers, or a probe is slow: vLLM asks again
            return None, False
        if n < len(look) and self._storing.storing(look[n]):
            # The hit would go on with a block this engine is still storing (an earlier
            # request's, finished or not): ask again next step rather than recompute it.
            self._count("lookup_store_waits")
            return None, False
        if self._shared is None:  # cost-aware loading (local placement: in _lookup_local)
            n = self._affordable(look, n)
        n //= self._per  # whole blocks (head shards: every shard of each)
        if n == 0:
            return 0, False
        st.hit = (start, n)
        self._describe(st, start, start + n)
        self._count("lookup_hit_blocks", n)
        if self._shared is None and self._sync_mediums:
            # Held in memory by every rank that loads it: loaded before this step's forward,
            # so the request runs in this step, not after the step that reports a load done.
            st.sync = self.remote.held_in(look[: n * self._per], self._sync_mediums)
            self._count("sync_load_hits" if st.sync else "async_load_hits")
        # Asynchronous loads (remote, direct) keep the request's blocks out of vLLM's prefix
        # cache until loaded: a block that fails is recomputed by this request alone. A
        # synchronous one that fails is recomputed by every request that shares its blocks.
        return n * bs, (self._shared is None and not st.sync) or st.direct

    def _gkeys(self, st: _Req, group: KVGroup, n_blocks: int) -> list[bytes]:
        """The first `n_blocks` keys of `group` (hybrid models), extended as blocks fill."""
        have = st.gkeys.setdefault(group.index, [])
        if len(have) < n_blocks:
            base = self._keys(st, n_blocks)
            have.extend(group_keys(base[len(have) :], group.name))
        return have[:n_blocks]

    def _has_fn(self) -> Any:
        """Hybrid lookups: a quick "is this key worth asking for" (local: the manager's lookup
        of the key alone, which also wakes dormant blocks; remote: `RemoteIndex.has_fn`)."""
        if self._shared is not None:
            manager = self._shared.cache.manager
            return lambda k: manager.lookup_ready((k,), count=False, leaving=True)[0] > 0
        return self.remote.has_fn()

    def _match_groups(self, st: _Req, start: int, limit: int) -> tuple[int | None, bool]:
        """`get_num_new_matched_tokens` for several KV cache groups: the longest hit from
        block `start` every group can serve (`kv_groups.hit_end`), confirmed by the usual
        lookup over exactly the keys it loads. Loads are asynchronous; a failed one fails the
        request's receive (recomputed whole)."""
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
                m = self.remote.lookup(keys, st.request.request_id)
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

    def _describe(self, st: _Req, lo: int, hi: int) -> None:
        """vLLM's events on: describe the request's blocks [lo, hi) for them (kv_events.py)."""
        tr = self._translator
        if tr is None:
            return
        for p in range(lo, hi):
            key = st.keys[p]
            if tr.described(key):
                continue
            d = describe(st.request, p, self._block_size, st.keys[p - 1] if p else None)
            if d is not None:
                tr.record(key, d)

    def _expect(self, keys: list[bytes], skeys: list[bytes] | None = None) -> None:
        """Head shards: the blocks of `keys` (`skeys`: their shard keys) may be announced to
        vLLM as blocks (`ShardEvents`); those whole already in a medium are, now."""
        if self._shard_events is not None:
            for medium, blocks in self._shard_events.expect(keys, skeys).items():
                self._events.append((tuple(blocks), medium, False))
            for medium, blocks in self._shard_events.take_forgotten().items():
                self._events.append((tuple(blocks), medium, True))

    def _affordable(self, keys: list[bytes], n: int) -> int:
        """Cost-aware loading: how many of the `n` leading hit `keys` to load (the rest is
        recomputed), by the tier each block would load from: the first holding it (the
        slowest rank's or shard's; whole blocks only); a block found by a probe counts as the
        last tier's."""
        per = self._per
        if self._shards is not None:
            n = self._shards.whole(n, per)
        if n == 0:
            return 0
        names = [t.name for t in self._config.tiers]
        last = len(names) - 1
        if self._shared is not None:
            manager = self._shared.cache.manager
            at = [last if w < 0 else w for w in manager.first_tiers(keys[:n], leaving=True)]
        else:
            order = {m: i for i, m in enumerate(names)}
            at = []
            for i, k in enumerate(keys[:n]):
                ranks = self.remote.ranks(k)
                if self._shards is not None:  # a shard loads from its owner's tiers
                    ranks = {0: ranks.get(self._shards.owner(i), set())}
                fastest = [min(order.get(m, last) for m in ms) for ms in ranks.values() if ms]
                at.append(max(fastest, default=last))
        tiers = [names[max(at[i : i + per])] for i in range(0, n, per)]
        block_bytes = self.settings.engine_block_bytes or self.settings.block_bytes
        d = self._gate.decide(tiers, block_bytes=block_bytes, block_tokens=self._block_size)
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
        return d.load * per

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is not None and admissions.isEnabledFor(logging.DEBUG):
            admissions.debug(
                "admitted %s: %d prompt tokens, %d from the engine's cache, %d from tiercache",
                request.request_id,
                request.num_prompt_tokens,
                st.local,
                num_external_tokens,
            )
        if num_external_tokens == 0:
            return
        assert st is not None, request.request_id
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
            # Head shards (TP 1 here: this rank owns every shard): the shards' keys, whole
            # blocks only.
            look = keys if self._shards is None else self._shards.keys(keys)
            with self._shared.lock:
                m = len(manager.first_tiers(look, leaving=True, stop=True))
                m = self._shards.whole(m) if self._shards is not None else m
                spec = manager.prepare_load(look[:m], leaving=True) if m else None
        asynchronous = self._hma or st.direct
        remote = self._shared is None
        job = LoadJob(request.request_id, keys, targets, spec, remote, asynchronous, st.sync)
        self._loads.append(job)
        st.hit, st.direct, st.sync = (0, 0), False, False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TierCacheConnectorMetadata:
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
        if not self.settings.stores_on:  # kv_consumer: loads only
            steps = []
        planned: set[bytes] = set()  # hybrid: full-attention keys stored by this step
        for req_id, new_groups, replace, computed in steps:
            st = self._reqs.get(req_id)
            if st is None or st.skip:  # never asked about (prefix caching off), or embeddings
                continue
            if replace or not st.block_ids:
                groups = max(1, len(self._groups))
                st.block_ids = [list(ids) for ids in (new_groups or [[] for _ in range(groups)])]
            elif new_groups:
                for have, add in zip(st.block_ids, new_groups, strict=True):
                    have.extend(add)
            # num_computed_tokens can go backwards (a recomputed load error, a preemption):
            # blocks from there on are saved again once recomputed.
            st.stored = min(st.stored, computed // bs)
            done = (computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)) // bs
            done = min(done, *(len(ids) for ids in st.block_ids), st.request.num_tokens // bs)
            if done <= st.stored:
                continue
            if self._hma:
                self._plan_groups(meta, st, done, planned)
                st.stored = done
                continue
            keys = self._keys(st, done)
            ids = st.block_ids[0][st.stored : done]
            if 0 not in ids:  # the null block stands for a block vLLM does not hold
                meta.stores.append(StoreJob(req_id, tuple(keys[st.stored : done]), tuple(ids)))
                self._describe(st, st.stored, done)
                self._expect(keys[st.stored : done])
                if self._shared is None and self._shards is None:
                    self._storing.planned(req_id, keys[st.stored : done])
                # Every rank saves its shard and reports the plan once.
                self._pending[req_id] = self._pending.get(req_id, 0) + self._tp_size
            st.stored = done
        return meta

    def _plan_groups(
        self, meta: TierCacheConnectorMetadata, st: _Req, done: int, planned: set[bytes]
    ) -> None:
        """`build_connector_meta` for several KV cache groups: the blocks completed from
        `st.stored` to `done` (only those: vLLM frees a sliding window's blocks without telling
        the connector), all for full attention, for sliding windows those `_window_keep` keeps."""
        bs = self._block_size
        req_id = st.request.request_id
        keep = self._window_keep(st, st.stored, done, planned)
        keys: list[bytes] = []
        ids: list[int] = []
        groups: list[int] = []
        for g in self._groups:
            gk = self._gkeys(st, g, done)
            for p in range(st.stored, done):
                b = st.block_ids[g.index][p]
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

    def _window_keep(self, st: _Req, lo: int, hi: int, planned: set[bytes]) -> dict[int, set[int]]:
        """Per sliding-window group, the block positions in [lo, hi) to store: the window before
        each block where a later hit is likely to end (so stored bytes stay bounded by the
        window): the end of the prompt's hit, where this request's lookup found the stored
        prefix ending (`_Req.marks`), and where this request leaves what the store holds or
        another request of this step stores (a shared prefix ends there). A hit ending
        elsewhere is served by the nearest such block before it."""
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
        return lambda k: k in planned or self.remote.knows(k)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, TierCacheWorkerMetadata):
            return
        self.remote.suspend(meta.suspended)
        self.remote.damaged(meta.bad)
        if self._shared is None and (meta.load_samples or meta.forward_samples):
            # Cost samples (remote placement; local shares the cache's estimates).
            self._gate.costs.absorb(meta.load_samples, meta.forward_samples)
        for req_id, n in meta.plans_done.items():
            left = self._pending.get(req_id, 0) - n
            if left > 0:
                self._pending[req_id] = left
            else:
                self._pending.pop(req_id, None)
                self._storing.finished(req_id)
        kept = set(meta.kept)  # forgotten from a shared tier, still loadable (kv_events)
        for rank, keys, medium, removed in meta.events:
            vkeys = tuple(k for k in keys if k not in kept) if removed and kept else keys
            if self._shard_events is not None:
                blocks = self._shard_events.apply(vkeys, medium, removed)
                if blocks:
                    self._events.append((tuple(blocks), medium, removed))
            elif self._tp_size == 1 and self._vllm_events and (vkeys or vkeys is keys):
                self._events.append((vkeys, medium, removed))
            if self._shared is None:
                self._index_event(rank, keys, medium, removed)

    def _index_event(self, rank: int, keys: tuple[bytes, ...], medium: str, removed: bool) -> None:
        """Remote placement: `rank` now holds (or no longer holds) `keys` in `medium`; with
        TP > 1 (not head shards: `ShardEvents`), vLLM hears of the keys every rank now holds
        there, or no longer all do."""
        changed = self.remote.apply(rank, keys, medium, removed)
        if self._tp_size > 1 and changed and self._vllm_events and self._shards is None:
            self._events.append((changed, medium, removed))

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

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self.remote.forget(request.request_id)
        if self.local_lookup is not None:
            self.local_lookup.forget(request.request_id)
        if self._pending.get(request.request_id, 0) > 0:
            self._delayed.append(request.request_id)
            return True, None
        self._storing.finished(request.request_id)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The blocks stored and removed since the last call, described for routers
        (`kv_events.EventTranslator`); blocks with no description are not reported."""
        events, self._events = self._events, []
        tr = self._translator
        if tr is None:
            return []
        for keys, medium, removed in events:
            tr.apply(keys, medium, removed)
        if self._shared_blocks is not None:
            self._shared_blocks.poll(tr)
        return tr.take()
