"""The connector's small records against vLLM's real base classes (no engine needed)."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tests.polling import wait_until
from tiercache.config import CacheConfig
from tiercache.connectors.deadlines import Flights
from tiercache.connectors.namespace import resolve_config
from tiercache.connectors.stores import acquire_store, release_store
from tiercache.connectors.vllm import (
    TierCacheConnector,
    TierCacheConnectorMetadata,
    TierCacheConnectorStats,
)
from tiercache.connectors.vllm_kv import (
    SETTLE_KEY,
    KVScheduler,
    KVSettings,
    KVWorker,
    LoadJob,
    StoreJob,
    TierCacheHandshake,
    TierCacheWorkerMetadata,
)
from tiercache.connectors.vllm_kv.settings import _memory_loads
from tiercache.errors import ConfigError
from tiercache.transfer.head_shards import HeadShards


def test_connector_implements_every_abstract_method_of_vllms_base() -> None:
    assert issubclass(TierCacheConnector, KVConnectorBase_V1)
    assert not TierCacheConnector.__abstractmethods__


def test_sleep_mode_is_refused() -> None:
    # vLLM >= 0.33 asks this before enabling sleep mode (see supports_sleep_mode's docstring).
    assert TierCacheConnector.supports_sleep_mode(None) is False


def test_worker_metadata_aggregates_across_workers() -> None:
    a = TierCacheWorkerMetadata(events=[(0, (b"k" * 16,), "cpu", False)], plans_done={"r1": 1})
    b = TierCacheWorkerMetadata(
        events=[(1, (b"k" * 16,), "cpu", True)], plans_done={"r1": 2, "r2": 1}
    )
    out = a.aggregate(b)
    assert isinstance(out, KVConnectorWorkerMetadata)
    assert out.plans_done == {"r1": 3, "r2": 1}
    assert [(e[0], e[3]) for e in out.events] == [(0, False), (1, True)]


def _scheduler(tp_size: int) -> KVScheduler:
    """The scheduler role's index and bookkeeping alone (remote placement), without vLLM."""
    config = CacheConfig.from_mapping({"tiers": [{"kind": "cpu", "blocks": 8}]})
    return KVScheduler(KVSettings(config, block_size=4, block_bytes=64, tp_size=tp_size))


def _local(config: CacheConfig, shared: Any) -> KVScheduler:
    """The scheduler role on a shared store (local placement), without vLLM."""
    return KVScheduler(KVSettings(config, block_size=4, block_bytes=64), shared)


def _ask(c: KVScheduler, keys: list[bytes]) -> int:
    """`RemoteIndex.lookup` as vLLM calls it: again while it answers None (a probe runs)."""
    while (n := c.remote.lookup(keys, "req")) is None:
        pass
    return n


def _out(*metas: TierCacheWorkerMetadata) -> SimpleNamespace:
    first, *rest = metas
    for m in rest:
        first.aggregate(m)
    return SimpleNamespace(kv_connector_worker_meta=first)


K1, K2 = b"1" * 16, b"2" * 16


def test_tp_index_hits_only_keys_every_rank_holds() -> None:
    c = _scheduler(2)
    c.update_connector_output(
        _out(
            TierCacheWorkerMetadata(events=[(0, (K1, K2), "cpu", False)]),
            TierCacheWorkerMetadata(events=[(1, (K1,), "nvme", False)]),
        )
    )
    # K1: rank 0 in cpu, rank 1 in nvme: held by both (in different tiers); K2 by rank 0 only.
    assert c.remote.held_by_all(K1) and not c.remote.held_by_all(K2)
    assert c._events == []  # no tier holds K1 on both ranks yet: nothing announced
    c.update_connector_output(_out(TierCacheWorkerMetadata(events=[(1, (K1, K2), "cpu", False)])))
    assert c.remote.held_by_all(K2)
    assert c._events == [((K1, K2), "cpu", False)]
    # Rank 0 demotes K1: still held by both; vLLM hears it left the cpu tier.
    c._events = []
    c.update_connector_output(
        _out(TierCacheWorkerMetadata(events=[(0, (K1,), "cpu", True), (0, (K1,), "nvme", False)]))
    )
    assert c.remote.held_by_all(K1)
    assert c._events == [((K1,), "cpu", True), ((K1,), "nvme", False)]
    # Rank 1 drops K2: no longer a hit, and the index forgets rank 1 for it.
    c.update_connector_output(_out(TierCacheWorkerMetadata(events=[(1, (K2,), "cpu", True)])))
    assert not c.remote.held_by_all(K2) and set(c.remote._index[K2]) == {0}


def test_tp_handshake_per_rank() -> None:
    c = _scheduler(2)
    c.set_xfer_handshake_metadata(
        {
            0: TierCacheHandshake(held={"lmdb": (K1, K2)}, rank=0),
            1: TierCacheHandshake(held={"lmdb": (K1,)}, rank=1),
        }
    )
    assert c.remote.held_by_all(K1) and not c.remote.held_by_all(K2)
    assert c._events == [((K1,), "lmdb", False)]


def test_tp1_index_and_events_unchanged() -> None:
    c = _scheduler(1)
    c.update_connector_output(_out(TierCacheWorkerMetadata(events=[(0, (K1,), "cpu", False)])))
    assert c.remote.held_by_all(K1) and c._events == [((K1,), "cpu", False)]


def test_tp_save_plans_finish_when_every_rank_reported() -> None:
    c = _scheduler(2)
    c._pending = {"r": 2}  # one store plan, expected from each of the 2 ranks
    c.update_connector_output(_out(TierCacheWorkerMetadata(plans_done={"r": 1})))
    assert c._pending == {"r": 1}  # rank 1 still saving: request_finished keeps the blocks
    c.update_connector_output(_out(TierCacheWorkerMetadata(plans_done={"r": 1})))
    assert c._pending == {}


def test_metadata_crosses_process_boundaries() -> None:
    # Multiprocess vLLM pickles scheduler output and worker replies between processes.
    meta = TierCacheConnectorMetadata(
        loads=[LoadJob("r", (b"a" * 16,), (3,), None, True)],
        stores=[StoreJob("r", (b"b" * 16,), (4,))],
        delayed=["q"],
    )
    assert isinstance(meta, KVConnectorMetadata)
    back = pickle.loads(pickle.dumps(meta))
    assert back == meta
    hs = TierCacheHandshake(held={"nvme": (b"c" * 16,)})
    assert pickle.loads(pickle.dumps(hs)) == hs


def test_stats_aggregate_and_reduce() -> None:
    s = TierCacheConnector.build_kv_connector_stats({"loaded_blocks": 2})
    assert isinstance(s, TierCacheConnectorStats) and not s.is_empty()
    s.aggregate(TierCacheConnectorStats(data={"loaded_blocks": 3, "bytes": 10}))
    assert s.reduce() == {"loaded_blocks": 5, "bytes": 10}
    s.reset()
    assert s.is_empty()


def test_a_lookup_that_waits_for_a_store_counts_each_block_once() -> None:
    """Issue 14, item 5: when a chain continues with blocks the worker is still storing, the
    scheduler waits for them (`settle`) and looks again. The second look used to count every
    block a second time; each block asked for once is now one hit or one miss."""
    config = resolve_config({"tiers": [{"kind": "cpu", "blocks": 8}]}, block_size=4, namespace="t")
    shared = acquire_store(config, 64)
    try:
        cache, manager = shared.cache, shared.cache.manager
        keys = cache.hash_tokens(list(range(16)))  # 4 blocks
        cache.put(keys[:2], torch.zeros((2, 64), dtype=torch.uint8))
        assert manager.prepare_store(keys[2:]) is not None  # the worker is storing these

        def settle(key: bytes) -> bool:  # the worker finishes the store it was running
            manager.complete_store(keys[2:])
            return True

        shared.state[SETTLE_KEY] = settle
        c = _local(config, shared)
        before = cache.stats()["cpu"]
        assert c._lookup_local(keys) == 4
        after = cache.stats()["cpu"]
        # Counted once, as the tier held them when asked: 2 ready, 2 still being stored.
        assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (2, 2)
    finally:
        release_store(shared)


def test_remote_lookup_probes_shared_tiers_where_the_index_ends(tmp_path) -> None:
    """Issue 15, item 2: in multiprocess mode the scheduler's index knows only its own
    workers' keys. Where it ends, the scheduler probes the shared tiers (read-only) for
    blocks other engines stored, per rank, as the worker's discovery will adopt them."""
    from tiercache.connectors.probes import open_probes

    chain = [bytes([i]) * 16 for i in range(1, 7)]
    stores, probes = [], []
    for r in range(2):  # each TP rank keeps its shard in a store of its own
        config = resolve_config(
            {
                "tiers": [
                    {"kind": "cpu", "blocks": 4},
                    {"kind": "lmdb", "blocks": 32, "path": str(tmp_path / f"r{r}")},
                ]
            },
            block_size=4,
            namespace=f"rank{r}",
        )
        stores.append(acquire_store(config, 64))
        probes.append(open_probes(config, 64))
    try:
        # "Another engine" stored chain[1:4] for rank 0 and chain[1:3] for rank 1.
        stores[0].cache.put(chain[1:4], torch.zeros((3, 64), dtype=torch.uint8))
        stores[1].cache.put(chain[1:3], torch.zeros((2, 64), dtype=torch.uint8))
        for s in stores:
            s.cache.flush()  # the write-through copies into LMDB done
        c = _scheduler(2)
        # This engine's workers hold chain[0] (both ranks) and chain[3] (rank 1 only).
        c.update_connector_output(
            _out(
                TierCacheWorkerMetadata(events=[(0, (chain[0],), "cpu", False)]),
                TierCacheWorkerMetadata(events=[(1, (chain[0], chain[3]), "cpu", False)]),
            )
        )
        assert _ask(c, chain) == 1  # the index alone
        c.remote._probes, c.remote._probe_pool = probes, ThreadPoolExecutor(1)
        c.remote._shared_mediums = frozenset({"lmdb"})
        # rank 0: index 1, probe 3 -> 4; rank 1: index 1, probe 2, index 1 -> 4.
        assert _ask(c, chain) == 4
        assert c._stats["probe_hit_blocks"] == 3
        c.remote._probes = [probes[0], []]  # rank 1 without a shared tier: the index only
        assert _ask(c, chain) == 1
        # A worker's circuit breaker suspended the cpu tier (a load missed its deadline):
        # what only it holds is no hit, or vLLM would ask, fail and ask again in a loop.
        c.remote._probes = probes
        c.update_connector_output(
            _out(
                TierCacheWorkerMetadata(suspended={"cpu": 60.0}),
                TierCacheWorkerMetadata(suspended={"cpu": 1.0, "lmdb": 0.0}),
            )
        )
        assert _ask(c, chain) == 0 and not c.remote.held_by_all(chain[0], frozenset({"cpu"}))
        c.remote._off["cpu"].until = 0.0  # its back-off is over
        assert _ask(c, chain) == 4
        # The workers hold chain[0] in LMDB too, by their events, but the shared store no
        # longer does (another engine's stores evicted it): the probes decide, not the index.
        c.update_connector_output(
            _out(
                TierCacheWorkerMetadata(events=[(0, (chain[0],), "cpu", True)]),
                TierCacheWorkerMetadata(
                    events=[(r, (chain[0],), "lmdb", False) for r in (0, 1)]
                    + [(1, (chain[0],), "cpu", True)]
                ),
            )
        )
        assert set(c.remote._index[chain[0]][0]) == {"lmdb"}
        assert _ask(c, chain) == 0  # a plain miss, not a load that fails
        # A worker found chain[2] damaged (its header well-formed, its checksum not): the
        # probes stop before it, or vLLM would be offered it, fail and ask again, for ever.
        c.remote._index.pop(chain[0])
        c.update_connector_output(
            _out(TierCacheWorkerMetadata(events=[(r, (chain[0],), "cpu", False) for r in (0, 1)]))
        )
        assert _ask(c, chain) == 4
        c.update_connector_output(_out(TierCacheWorkerMetadata(bad=[chain[2]])))
        assert _ask(c, chain) == 2
    finally:
        if c.remote._probe_pool is not None:
            c.remote._probe_pool.shutdown()
        for _, p in (p for ps in probes for p in ps):
            p.close()
        for s in stores:
            release_store(s)


class _HungProbe:
    """A store that answers only once released (a hung Redis)."""

    def __init__(self, held: list[bytes]) -> None:
        self.held, self.release, self.calls = set(held), threading.Event(), 0

    def probe(self, keys: list[bytes]) -> int:
        self.calls += 1
        self.release.wait(60)
        return next((i for i, k in enumerate(keys) if k not in self.held), len(keys))

    def close(self) -> None:
        self.release.set()


def test_a_slow_probe_never_stalls_the_scheduler() -> None:
    """Issue 16: lookups must never stall scheduling. A probe that does not answer within
    PROBE_WAIT_S makes the lookup answer None (vLLM asks again next step) while the probe
    goes on; once it answers, the next lookup uses it, without probing twice."""
    chain = [bytes([i]) * 16 for i in range(1, 5)]
    hung = _HungProbe(chain[:3])
    c = _scheduler(1)
    c.remote._probes, c.remote._probe_pool = [[("redis", hung)]], ThreadPoolExecutor(1)
    try:
        assert c.remote.lookup(chain, "r") is None
        assert c.remote.lookup(chain, "r") is None  # still waiting: the same probe
        assert c._stats["probe_waits"] == 2
        hung.release.set()
        assert _ask(c, chain) == 3  # another request: a probe of its own
        while (n := c.remote.lookup(chain, "r")) is None:
            pass
        assert n == 3
        assert hung.calls == 4  # per request: its run, then where the run ended
        assert c.remote._probing == {}
    finally:
        c.remote._probe_pool.shutdown()


def test_a_hung_verifying_read_never_stalls_scheduling(tmp_path) -> None:
    """Issue 16: in the local placement the scheduler reads blocks held only on disk before
    it promises them. With the disk hung, the lookup answers None within about
    VERIFY_WAIT_S (vLLM asks again), the cache stays usable meanwhile (the read does not hold
    its lock), and after `load_timeout` the hit ends before the hung blocks and the tier is
    suspended."""

    config = resolve_config(
        {
            "tiers": [{"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 16}],
            "deadlines": {"load_timeout": 0.5, "backoff": 5.0, "backoff_max": 5.0},
        },
        block_size=4,
        namespace="hung-verify",
    )
    shared = acquire_store(config, 64)
    release = threading.Event()
    try:
        cache = shared.cache
        keys = cache.hash_tokens(list(range(16)))
        cache.put(keys, torch.ones((4, 64), dtype=torch.uint8))
        nvme = cache.tiers[0]
        read = nvme.read
        hanging = threading.Event()

        def hung_read(slots, dst, keys=None):
            hanging.set()
            release.wait(60)  # far past every deadline below: a lookup that waited shows
            return read(slots, dst, keys)

        nvme.read = hung_read
        c = _local(config, shared)
        t0 = time.monotonic()
        asks = 0
        while (n := c._lookup_local(keys, "r1")) is None:
            asks += 1
            # Each ask came back while the read still hangs (conditions, not timings: the
            # host may be busy) ...
            assert hanging.is_set() and not release.is_set()
            # ... and the engine's other calls take the cache's lock meanwhile.
            assert cache.stats()["nvme"]["used_blocks"] == 4
        # The hit ended at `load_timeout` (0.5 s, a lower bound), the read still hanging.
        assert n == 0 and time.monotonic() - t0 >= 0.5 and not release.is_set()
        # Each None was one bounded wait, and more than one came before the deadline (a
        # lookup that waited for the read would have none).
        assert asks == c._stats["verify_waits"] >= 2
        assert c._stats["verify_deadline_blocks"] == 4
        assert cache.manager.suspended()[0] > 0
        assert c._lookup_local(keys, "r2") == 0  # suspended: no hit, no read
        release.set()
        for pool in c.local_lookup._verify_pools.values():
            pool.shutdown(wait=True)  # the late read ends now ...
        # ... and is no cost sample: its seconds would make "auto" decline the tier for long.
        assert "nvme" not in cache.load_costs.tier_stats()
    finally:
        release.set()
        for pool in c.local_lookup._verify_pools.values():
            pool.shutdown(wait=True)
        release_store(shared)


def _cpu_then_nvme(tmp_path, namespace: str, **extra: Any) -> tuple[Any, Any, Any]:
    """A shared store of a 2-block CPU tier over NVMe (write-back: no copies beside the
    demotions), a connector on it, and three 2-block chains: `a` demoted into NVMe and `b`
    in the CPU tier (put in that order), `new` not stored. Returns (shared, connector,
    (a, b, new, rows)), `rows` mapping each key to its 64-byte block."""
    nvme = {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 16}
    tiers = [{"kind": "cpu", "blocks": 2}, {**nvme, "write_policy": "write-back"}]
    config = resolve_config({"tiers": tiers, **extra}, block_size=4, namespace=namespace)
    shared = acquire_store(config, 64)
    c = _local(config, shared)
    cache = shared.cache
    a, b = cache.hash_tokens(list(range(8))), cache.hash_tokens(list(range(100, 108)))
    new = cache.hash_tokens(list(range(200, 208)))
    rows = {k: torch.full((1, 64), i, dtype=torch.uint8) for i, k in enumerate(a + b + new)}
    cache.put(a, torch.cat([rows[k] for k in a]))
    cache.put(b, torch.cat([rows[k] for k in b]))
    m = cache.manager
    assert [m.where(k) for k in a + b] == [[1], [1], [0], [0]]
    return shared, c, (a, b, new, rows)


def test_a_verifying_read_that_meets_a_moving_block_asks_again(tmp_path) -> None:
    """A verifying read runs after the lookup that started it. Meanwhile another request's
    promotion can start demoting blocks of this chain (the worker moves them asynchronously).
    The read then stops at the moving block; the lookup answers None (vLLM asks again) rather
    than a hit cut short there, and once the move lands the whole chain hits. CI saw the cut:
    a prompt hit 64 of 192 tokens after a prefix-cache reset."""
    shared, c, (a, b, new, rows) = _cpu_then_nvme(tmp_path, "verify-moving")
    gate = threading.Event()
    try:
        cache, m = shared.cache, shared.cache.manager
        cat = lambda ks: torch.cat([rows[k] for k in ks])  # noqa: E731
        # The verify thread is busy with another request's read: this one waits its turn.
        pool = c.local_lookup._verify_pools[1] = ThreadPoolExecutor(1)
        pool.submit(gate.wait, 10)
        assert c._lookup_local(a + b, "r") is None
        with shared.lock:  # another store begins: b is moving into NVMe
            plan = m.prepare_store(new)
        assert plan is not None and {k for mv in plan.moves for k in mv.keys} == set(b)
        gate.set()
        for _ in range(40):  # the read ends at b[0]: asked again, never a hit cut there
            assert c._lookup_local(a + b, "r") is None
            if c._stats.get("verify_moving"):
                break
        assert c._stats.get("verify_moving") == 1
        with shared.lock:  # the move lands
            cache._runner.run_plan(plan, cat(new), new)
        while (n := c._lookup_local(a + b, "r")) is None:
            pass
        assert n == 4
        assert torch.equal(cache.get(a + b), cat(a + b))
    finally:
        gate.set()
        for p in c.local_lookup._verify_pools.values():
            p.shutdown(wait=True)
        release_store(shared)


def test_a_lookup_never_waits_for_ever_on_a_move_into_a_hung_tier(tmp_path) -> None:
    """A demotion into a hung tier never ends. While it is within its deadline, a lookup
    reaching one of its blocks answers None (vLLM asks again); once the worker gives it up
    at `store_timeout`, those blocks read as misses: after the tier's back-off, the chain
    hits up to them instead of asking again for ever."""
    from tiercache.connectors.vllm_kv import MOVE_WAIT_S, KVFlight

    deadlines = {"store_timeout": 0.2, "backoff": 0.2, "backoff_max": 0.2}
    shared, c, (a, b, new, _) = _cpu_then_nvme(tmp_path, "hung-move", deadlines=deadlines)
    # The worker role, minus the transfer threads: a move that never finishes.
    waits: list[float | None] = []
    w = KVWorker(c.settings, shared)
    w._worker = SimpleNamespace(
        wait=lambda jobs, timeout=None: waits.append(timeout) or list(jobs), get_finished=list
    )
    w._flights = Flights(w._worker, shared.cache.config.deadlines)
    shared.state[SETTLE_KEY] = w._settle
    try:
        m = shared.cache.manager
        with shared.lock:
            plan = m.prepare_store(new)  # b moves into NVMe ...
        assert plan is not None
        (move,) = plan.moves
        w._flights.add(0, KVFlight("move", move.keys, 1, plan=0))  # due in store_timeout
        assert c._lookup_local(a + b, "r") is None  # ... and is in flight: ask again
        assert waits == [MOVE_WAIT_S]  # the scheduler waited for it only briefly

        def step_gives_up() -> bool:  # one engine step: the worker's late scan
            w.get_finished(set())
            return w._flights.is_late(0)

        wait_until(step_gives_up, "the hung move given up at its deadline")  # never lands
        assert not m.is_moving(b[0])
        assert m.suspended()[1] > 0
        wait_until(lambda: m.suspended()[1] == 0, "the NVMe tier's back-off ended")
        answers = [c._lookup_local(a + b, "r") for _ in range(40)]
        assert 2 in answers, answers  # a hits; b is a miss, not "ask again" for ever
        t0 = time.monotonic()
        c._lookup_local(a + b, "r2")
        assert time.monotonic() - t0 < 0.2  # the lookup does not wait for the hung move
    finally:
        for p in c.local_lookup._verify_pools.values():
            p.shutdown(wait=True)
        shared.state.pop(SETTLE_KEY, None)
        w._worker = None
        release_store(shared)


def test_without_vllms_kv_events_the_index_learns_and_no_event_is_built() -> None:
    """vLLM drops the connector's events unless `kv_events_config.enable_kv_cache_events`:
    then none are built (head shards: no shard events mapped back to blocks), while the
    remote index still learns what every rank holds from the same worker events."""
    config = CacheConfig.from_mapping({"tiers": [{"kind": "cpu", "blocks": 8}]})
    shards = HeadShards(2, 2, 0)
    for tp, sh in ((1, None), (2, None), (2, shards)):
        kw: dict[str, Any] = {"tp_size": tp, "shards": sh}
        c = KVScheduler(KVSettings(config, block_size=4, block_bytes=64, events=False, **kw))
        keys = (K1,) if sh is None else tuple(sh.all_keys([K1]))
        metas = [
            TierCacheWorkerMetadata(
                events=[(r, keys if sh is None else keys[r : r + 1], "cpu", False)]
            )
            for r in range(tp)
        ]
        c.update_connector_output(_out(*metas))
        c._expect([K1])
        assert c._events == [] and list(c.take_events()) == [], (tp, sh)
        assert c._shard_events is None
        assert _ask(c, list(keys)) == len(keys), (tp, sh)  # a hit all the same
        # The same scheduler with vLLM's events on announces the block.
        on = KVScheduler(KVSettings(config, block_size=4, block_bytes=64, **kw))
        on._expect([K1])
        on.update_connector_output(_out(*metas))
        assert on._events == [((K1,), "cpu", False)], (tp, sh, on._events)


def test_each_admission_is_logged_with_its_engine_and_tiercache_tokens(caplog) -> None:
    """Issue 48: a serving bench counts reuse per request from one DEBUG line per admission:
    the prompt's tokens, those vLLM's own cache held (the lookup's num_computed_tokens) and
    those tiercache gives. Here vLLM's cache holds 1 block of a 5-block prompt, the index
    holds the next 2: the line says 4 and 8 tokens (block size 4)."""
    c = _scheduler(1)
    tokens = list(range(20))
    request = SimpleNamespace(
        request_id="r7", num_tokens=20, num_prompt_tokens=20, all_token_ids=tokens,
        lora_request=None, cache_salt=None, mm_features=None, prompt_embeds=None,
    )  # fmt: skip
    assert c.get_num_new_matched_tokens(request, 4) == (0, False)  # the index holds nothing
    keys = c._reqs["r7"].keys
    c.update_connector_output(
        _out(TierCacheWorkerMetadata(events=[(0, tuple(keys[1:3]), "cpu", False)]))
    )
    assert c.get_num_new_matched_tokens(request, 4) == (8, True)
    blocks = SimpleNamespace(get_block_ids=lambda: [[10, 11, 12, 13, 14]])
    caplog.set_level(logging.DEBUG, logger="tiercache.connectors.vllm_kv.admissions")
    c.update_state_after_alloc(request, blocks, 8)
    lines = [r.getMessage() for r in caplog.records if r.name.endswith(".admissions")]
    assert lines == ["admitted r7: 20 prompt tokens, 4 from the engine's cache, 8 from tiercache"]


def _req(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, num_tokens=len(tokens), num_prompt_tokens=len(tokens),
        all_token_ids=tokens, lora_request=None, cache_salt=None, mm_features=None,
        prompt_embeds=None,
    )  # fmt: skip


def _step(req_id: str, block_ids: list[int], tokens: int) -> SimpleNamespace:
    """A scheduler output computing `tokens` tokens of new request `req_id`."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=req_id, block_ids=(block_ids,), num_computed_tokens=0)
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        preempted_req_ids=set(),
        total_num_scheduled_tokens=tokens,
        num_scheduled_tokens={req_id: tokens},
    )


def test_a_remote_lookup_waits_for_blocks_this_engine_is_still_storing() -> None:
    """Issue 48 (lookups that run before a store completes): in the remote placement the
    scheduler knows a key only once the worker reports it stored. A request sharing a prefix
    whose store is planned but not reported used to miss it and recompute it; it now asks
    again (None) until the plan is reported, then hits the whole prefix."""
    c = _scheduler(1)
    prefix = list(range(16))  # 4 blocks of 4
    a, b = _req("a", [*prefix, 99]), _req("b", [*prefix, 98, 97])
    assert c.get_num_new_matched_tokens(a, 0) == (0, False)
    meta = c.build_connector_meta(_step("a", [1, 2, 3, 4, 5], 17))
    keys = meta.stores[0].keys
    assert len(keys) == 4  # the plan: a's 4 full blocks
    assert c.get_num_new_matched_tokens(b, 0) == (None, False)  # still being stored: wait
    assert c.take_stats()["lookup_store_waits"] == 1
    # The worker reports the plan done and the keys stored: b hits every prefix block.
    c.update_connector_output(
        _out(TierCacheWorkerMetadata(plans_done={"a": 1}, events=[(0, keys, "cpu", False)]))
    )
    assert c.get_num_new_matched_tokens(b, 0) == (16, True)


def test_a_remote_lookup_stops_waiting_for_a_plan_the_worker_never_reports() -> None:
    """A plan not reported within the store deadline is not waited for any longer, and a
    finished request with no plan left is forgotten: a lookup then misses, as before."""
    c = _scheduler(1)
    c._storing.wait_s = 0.0  # the deadline has passed as soon as the plan is made
    prefix = list(range(16))
    a, b = _req("a", [*prefix, 99]), _req("b", [*prefix, 98, 97])
    c.get_num_new_matched_tokens(a, 0)
    c.build_connector_meta(_step("a", [1, 2, 3, 4, 5], 17))
    assert c.get_num_new_matched_tokens(b, 0) == (0, False)
    c._storing.wait_s = 60.0
    c.get_num_new_matched_tokens(_req("c", [*prefix, 1, 2]), 0)
    c.build_connector_meta(_step("c", [6, 7, 8, 9, 10], 18))
    assert c.get_num_new_matched_tokens(b, 0) == (None, False)
    c.update_connector_output(_out(TierCacheWorkerMetadata(plans_done={"c": 1})))
    assert c.get_num_new_matched_tokens(b, 0) == (0, False)  # reported, but not held: a miss


@pytest.mark.parametrize(
    ("tiers", "held", "memory_loads", "sync"),
    [
        ([("cpu", 8)], {"cpu": 3}, "sync", True),  # every block in memory
        ([("cpu", 8), ("nvme", 8)], {"cpu": 2, "nvme": 3}, "sync", False),  # one on disk
        ([("cpu", 8), ("nvme", 8)], {"cpu": 3, "nvme": 3}, "sync", True),  # on both: memory
        ([("cpu", 8)], {"cpu": 3}, "async", False),  # memory_loads "async"
    ],
)
def test_a_remote_hit_held_in_memory_loads_before_the_forward(
    tmp_path, tiers, held, memory_loads, sync
) -> None:
    """Remote placement with `memory_loads` "sync": a hit every block of which the workers
    hold in a memory tier is a synchronous load (vLLM runs the request in this step; the
    worker loads before the forward); one that needs a disk tier stays asynchronous, as does
    every hit with "async" (the default)."""
    config = CacheConfig.from_mapping(
        {
            "tiers": [
                {"kind": k, "blocks": n, **({"path": str(tmp_path / k)} if k != "cpu" else {})}
                for k, n in tiers
            ]
        }
    )
    c = KVScheduler(
        KVSettings(config, block_size=4, block_bytes=64, sync_memory_loads=memory_loads == "sync")
    )
    request = _req("r", list(range(20)))
    assert c.get_num_new_matched_tokens(request, 0) == (0, False)
    keys = c._reqs["r"].keys
    for medium, n in held.items():  # the worker's events: its tiers hold the first n blocks
        c.update_connector_output(
            _out(TierCacheWorkerMetadata(events=[(0, tuple(keys[:n]), medium, False)]))
        )
    assert c.get_num_new_matched_tokens(request, 0) == (12, not sync)
    c.update_state_after_alloc(
        request, SimpleNamespace(get_block_ids=lambda: [[1, 2, 3, 4, 5]]), 12
    )
    (job,) = c.build_connector_meta(_step("r", [1, 2, 3, 4, 5], 8)).loads
    assert job.remote and job.sync == sync and job.keys == tuple(keys[:3])
    assert job.block_ids == (1, 2, 3)
    assert c.take_stats().get("sync_load_hits", 0) == int(sync)


def test_memory_loads_takes_sync_or_async_and_names_a_bad_value() -> None:
    assert _memory_loads(None) == "async" and _memory_loads({}) == "async"
    assert _memory_loads({"memory_loads": "sync"}) == "sync"
    for bad in ("SYNC", True, 1, None):
        with pytest.raises(ConfigError, match=r"memory_loads.*'sync' or 'async'"):
            _memory_loads({"memory_loads": bad})
