"""The facade keeps the engine's promises at its seams (issue 14): a store is not a use, every
plan completes or rolls back whatever is raised, one block asked for once is counted once, and
a refused store changes no policy state. Real tensors, real tiers, the public `TierCache`."""

from __future__ import annotations

import random

import pytest
import torch

from tiercache import TierCache
from tiercache.manager import OffloadingManager
from tiercache.policies import ARCPolicy
from tiercache.tiers.cpu import CPUTier
from tiercache.workload import block_bytes_for

N = 64


def cfg(*caps: int, policy: str = "lru", promote: bool = True) -> dict:
    tiers = [{"kind": "cpu", "blocks": caps[0], "policy": policy}]
    tiers += [
        {"kind": "gpu", "device": "cpu", "name": f"low{i}", "blocks": c, "policy": policy}
        for i, c in enumerate(caps[1:])
    ]
    return {"block_size": 4, "namespace": "seams/bf16/tp1/0", "tiers": tiers, "promote": promote}


def chain_of(cache: TierCache, start: int, blocks: int) -> list[bytes]:
    return cache.hash_tokens(list(range(start, start + 4 * blocks)))


# -- 1. a store is not a use ----------------------------------------------------------------
def hot_set_hit_rate(policy: str, requests: int = 1000) -> float:
    """50 hot chains of 10 blocks in a 1,000-block tier, every 5th request a one-off scan of
    100 blocks; each request is lookup -> get of the hits -> put of the misses."""
    rng = random.Random(7)
    hits = asked = 0
    with TierCache.open(cfg(1000, policy=policy), block_bytes=N) as cache:
        hot = [chain_of(cache, 1000 * i, 10) for i in range(50)]
        zeros = torch.zeros((100, N), dtype=torch.uint8)
        for r in range(requests):
            scan = r % 5 == 4
            keys = chain_of(cache, 10**7 + 1000 * r, 100) if scan else hot[rng.randrange(50)]
            n = cache.lookup(keys)
            assert cache.get(keys).shape[0] == n
            if n < len(keys):
                cache.put(keys[n:], zeros[: len(keys) - n])
            if not scan:
                hits, asked = hits + n, asked + len(keys)
    return hits / asked


def test_arc_keeps_a_hot_set_through_scans_at_the_facade() -> None:
    lru, arc = hot_set_hit_rate("lru"), hot_set_hit_rate("arc")
    # With put counted as a use, ARC moved every stored block straight into T2 and scored
    # exactly LRU's 0.45 here; as a scan-resistant policy it keeps most of the hot set.
    assert lru < 0.6
    assert arc > lru + 0.3, (lru, arc)


def test_new_blocks_enter_arc_recency_list_once() -> None:
    with TierCache.open(cfg(16, policy="arc"), block_bytes=N) as cache:
        keys = chain_of(cache, 0, 4)
        blocks = block_bytes_for(keys, N)
        cache.put(keys, blocks)
        arc = cache.manager.policies[0]
        assert isinstance(arc, ARCPolicy)
        assert (len(arc.state().t1), len(arc.state().t2)) == (4, 0)  # stored once: recency
        # Putting them again is a use of blocks already held: now they are frequent.
        cache.put(keys, blocks)
        assert (len(arc.state().t1), len(arc.state().t2)) == (0, 4)
        # A get is a use as well; new blocks beside held ones still enter T1.
        more = chain_of(cache, 0, 6)
        cache.put(more, block_bytes_for(more, N))
        assert set(arc.state().t1) == set(more[4:]) and set(arc.state().t2) == set(keys)


# -- 5. one block asked for once is one hit or one miss -------------------------------------
def counts(cache: TierCache) -> dict[str, tuple[int, int]]:
    return {m: (s["hits"], s["misses"]) for m, s in cache.stats().items()}


def test_lookup_then_get_counts_each_block_once() -> None:
    with TierCache.open(cfg(16), block_bytes=N) as cache:
        keys = chain_of(cache, 0, 5)
        cache.put(keys[:3], block_bytes_for(keys[:3], N))
        assert counts(cache) == {"cpu": (0, 0)}
        # The README's usage: lookup, then get of the same chain, is one request.
        assert cache.lookup(keys) == 3
        assert cache.get(keys).shape[0] == 3
        assert counts(cache) == {"cpu": (3, 2)}
        # get alone is a request too.
        cache.get(keys)
        assert counts(cache) == {"cpu": (6, 4)}
        # lookup alone as well; a get of a prefix right after it is part of that request.
        assert cache.lookup(keys) == 3
        cache.get(keys[:3])
        assert counts(cache) == {"cpu": (9, 6)}
        # A get after another call (here a put) is a new request.
        cache.lookup(keys)
        cache.put(keys[:1], block_bytes_for(keys[:1], N))
        cache.get(keys)
        assert counts(cache) == {"cpu": (15, 10)}


def test_counts_per_tier_once_with_two_tiers() -> None:
    with TierCache.open(cfg(2, 8, promote=False), block_bytes=N) as cache:
        keys = chain_of(cache, 0, 4)
        blocks = block_bytes_for(keys, N)
        cache.put(keys[:2], blocks[:2])
        cache.put(keys[2:], blocks[2:])  # keys[:2] demoted to low0
        assert cache.manager.where(keys[0]) == [1] and cache.manager.where(keys[2]) == [0]
        assert cache.lookup(keys) == 4
        assert torch.equal(cache.get(keys), blocks)
        # cpu served keys[2:], low0 keys[:2]: a block below the first tier is a first-tier
        # miss (it was looked for there first) and a hit below, once each.
        assert counts(cache) == {"cpu": (2, 2), "low0": (2, 0)}


# -- 2. every plan completes or rolls back, whatever is raised ------------------------------
class Boom(Exception):
    """An arbitrary exception, neither OSError nor BlockCorruptError."""


def assert_consistent(cache: TierCache, keys: list[bytes], blocks: torch.Tensor) -> None:
    """No slot leaked, nothing stuck moving, and the keys store and load again exactly."""
    m = cache.manager
    for lv_stats, tier in zip(cache.stats().values(), cache.tiers, strict=True):
        assert lv_stats["used_blocks"] == lv_stats["ready_blocks"], tier.medium
    for k in keys:
        assert not m.is_pending(k)
        assert m.lookup([k]) is not None
    assert cache.put(keys, blocks) == len(keys)
    assert cache.lookup(keys) == len(keys)
    assert torch.equal(cache.get(keys), blocks)


def _raise_in(monkeypatch: pytest.MonkeyPatch, obj: object, name: str, after: int = 0) -> None:
    """Make `obj.name` raise Boom from its (after+1)-th call on."""
    real = getattr(obj, name)
    calls = {"n": 0}

    def boom(*a, **kw):
        calls["n"] += 1
        if calls["n"] > after:
            raise Boom(name)
        return real(*a, **kw)

    monkeypatch.setattr(obj, name, boom)


@pytest.mark.parametrize(
    "where",
    ["first-write", "rows", "move-read", "move-write", "second-chunk"],
)
def test_put_rolls_back_on_any_exception(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    import tiercache.plan_runner as runner_mod

    with TierCache.open(cfg(4, 8), block_bytes=N) as cache:
        old = chain_of(cache, 0, 4)
        cache.put(old, block_bytes_for(old, N))  # the first tier is full
        new = chain_of(cache, 1000, 4)
        blocks = block_bytes_for(new, N)
        with monkeypatch.context() as mp:
            if where == "first-write":
                _raise_in(mp, cache.tiers[0], "write")
            elif where == "rows":
                _raise_in(mp, runner_mod, "rows_of")
            elif where == "move-read":
                _raise_in(mp, cache.tiers[0], "read")
            elif where == "move-write":
                _raise_in(mp, cache.tiers[1], "write")
            else:  # the demotion's second chunk: the first one completed
                mp.setattr(runner_mod, "MOVE_CHUNK_BYTES", 2 * N)
                _raise_in(mp, cache.tiers[1], "write", after=1)
            with pytest.raises(Boom):
                cache.put(new, blocks)
        assert_consistent(cache, new, blocks)
        # What the interrupted demotion had not written is a miss now, never wrong bytes.
        old_blocks = block_bytes_for(old, N)
        for i, k in enumerate(old):
            if cache.manager.where(k):
                assert torch.equal(cache.get([k]), old_blocks[i : i + 1])


def test_promotion_rolls_back_on_any_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    with TierCache.open(cfg(2, 8), block_bytes=N) as cache:
        keys = chain_of(cache, 0, 4)
        blocks = block_bytes_for(keys, N)
        cache.put(keys[:2], blocks[:2])
        cache.put(keys[2:], blocks[2:])  # keys[:2] now only in low0
        with monkeypatch.context() as mp:
            # The promotion of keys[:2] evicts keys[2:] (demoted: low0's write runs first),
            # then writes into the first tier, which raises.
            _raise_in(mp, cache.tiers[0], "write")
            with pytest.raises(Boom):
                cache.get(keys[:2])
        assert_consistent(cache, keys, blocks)


def test_a_wedged_key_would_answer_moving_forever_without_rollback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The symptom vLLM saw: a demotion interrupted by an exception left its keys "moving",
    so lookup answered None (ask again) on every step."""
    with TierCache.open(cfg(2, 8), block_bytes=N) as cache:
        keys = chain_of(cache, 0, 4)
        cache.put(keys[:2], block_bytes_for(keys[:2], N))
        with monkeypatch.context() as mp:
            _raise_in(mp, cache.tiers[1], "write")
            with pytest.raises(Boom):
                cache.put(keys[2:], block_bytes_for(keys[2:], N))
        assert cache.manager.lookup(keys) is not None


def test_a_read_stops_at_a_moving_block_and_returns_what_precedes_it() -> None:
    """A connector demotes asynchronously, so a chain can continue into a block that is
    moving between tiers while another thread reads it (the connector's verifying read). The
    read returns the ready blocks before it: it used to return none at all, and a request
    then hit only the blocks before the first disk-held one (CI: 64 of 192 tokens)."""
    with TierCache.open(cfg(2, 8), block_bytes=N) as cache:
        a, b, c = chain_of(cache, 0, 2), chain_of(cache, 100, 2), chain_of(cache, 200, 2)
        blocks = {k: block_bytes_for([k], N) for k in a + b + c}
        rows = lambda ks: torch.cat([blocks[k] for k in ks])  # noqa: E731
        cache.put(a, rows(a))
        cache.put(b, rows(b))  # a is demoted into low0, b is in the first tier
        m = cache.manager
        assert [m.where(k) for k in a + b] == [[1], [1], [0], [0]]
        with cache._lock:  # a store the facade has not run yet: b is moving into low0
            plan = m.prepare_store(c)
        assert plan is not None and {k for mv in plan.moves for k in mv.keys} == set(b)
        assert m.lookup(a + b) is None and m.lookup_ready(a + b) == (2, True)
        assert cache.lookup(a + b) == 2
        assert torch.equal(cache.get(a + b), rows(a))
        with cache._lock:
            cache._runner.run_plan(plan, rows(c), c)
        assert torch.equal(cache.get(a + b), rows(a + b))
        assert_consistent(cache, a + b + c, rows(a + b + c))


# -- 8. a refused store changes nothing, ARC's state included -------------------------------
def test_refused_prepare_store_leaves_arc_state_alone() -> None:
    tier = CPUTier(name="cpu", block_bytes=8, capacity_blocks=4)
    m = OffloadingManager([tier], [ARCPolicy(4)])
    arc = m.policies[0]
    assert isinstance(arc, ARCPolicy)
    k = [i.to_bytes(16, "big") for i in range(12)]

    def store(keys: list[bytes]) -> None:
        out = m.prepare_store(keys)
        assert out is not None
        m.complete_store(out.keys_to_store)

    store(k[0:4])
    m.touch(k[0:2])  # k0, k1 into T2
    store(k[4:6])  # evicts into the ghost lists
    store(k[6:8])
    resident = [x for x in k[:8] if x in arc]
    m.prepare_load(resident)  # every resident block pinned: no room can be made
    before = arc.state()
    ghosts = [x for x in k[:8] if x in before.b1 or x in before.b2]
    assert ghosts, "the scenario needs ghost hits in the refused batch"
    assert m.prepare_store(ghosts[:2]) is None  # refused: pinned
    assert m.prepare_store(k[:9]) is None  # refused: larger than the tier
    assert arc.state() == before  # p, T1, T2, B1, B2 and pending as they were
    m.complete_load(resident)
    assert m.prepare_store(ghosts[:2]) is not None  # now it goes through, and adapts p
    assert arc.state() != before
