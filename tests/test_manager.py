"""OffloadingManager: scenario tests (one comment per step) and a hypothesis state machine
checking the two-phase lifecycle, pins, demotion and events against a simple model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiercache.manager import OffloadingManager
from tiercache.policies import ARCPolicy, LRUPolicy
from tiercache.tiers.cpu import CPUTier


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


def chain(a: int, b: int) -> list[bytes]:
    return [K(i) for i in range(a, b)]


def make(*caps: int, policy=LRUPolicy, promote: bool = True) -> OffloadingManager:
    tiers = [CPUTier(name=f"t{i}", block_bytes=8, capacity_blocks=c) for i, c in enumerate(caps)]
    return OffloadingManager(tiers, [policy(c) for c in caps], promote=promote)


def store(m: OffloadingManager, keys: list[bytes]):
    out = m.prepare_store(keys)
    assert out is not None
    for mv in out.moves:
        m.complete_store(mv.keys)
    m.complete_store(out.keys_to_store)
    return out


def test_store_is_invisible_until_complete() -> None:
    m = make(4)
    out = m.prepare_store(chain(0, 3))
    # Reserved but not ready: lookup sees nothing, a second prepare does not store again.
    assert out.keys_to_store == tuple(chain(0, 3)) and len(out.store_spec.slots) == 3
    assert m.lookup(chain(0, 3)) == 0
    assert all(m.is_pending(k) for k in chain(0, 3)) and not m.is_pending(K(3))
    assert m.prepare_store(chain(0, 3)).keys_to_store == ()
    # Completing makes them visible and emits one stored event.
    m.complete_store(chain(0, 3))
    assert m.lookup(chain(0, 3)) == 3 and not m.is_pending(K(0))
    (ev,) = m.take_events()
    assert (ev.keys, ev.medium, ev.removed) == (tuple(chain(0, 3)), "t0", False)
    assert m.take_events() == []


def test_failed_store_frees_slots() -> None:
    m = make(4)
    m.prepare_store(chain(0, 4))
    m.complete_store(chain(0, 4), success=False)
    assert m.lookup(chain(0, 4)) == 0 and m.tiers[0].used_blocks == 0
    assert not m.is_pending(K(0))  # a failed store is not pending: it is gone
    assert m.take_events() == []
    # The keys can be stored again afterwards.
    assert m.prepare_store(chain(0, 4)).keys_to_store == tuple(chain(0, 4))


@pytest.mark.parametrize("caps", [(4,), (4, 4)], ids=["one tier", "two tiers"])
def test_complete_store_with_repeated_keys_completes_each_once(caps: tuple[int, ...]) -> None:
    m = make(*caps, policy=ARCPolicy)
    m.prepare_store(chain(0, 2))
    # A connector may pass a key twice (e.g. one list per layer group, concatenated).
    m.complete_store([K(0), K(1), K(0), K(1)])
    (ev,) = m.take_events()
    assert ev.keys == tuple(chain(0, 2))
    assert m.stats()["t0"]["stored"] == 2
    # One store is one access: both keys are still in ARC's T1 (seen once), not in T2.
    assert m.policies[0].state().t1 == (K(1), K(0)) and m.policies[0].state().t2 == ()


def test_lookup_counts_leading_ready_only() -> None:
    m = make(8)
    store(m, chain(0, 2))
    store(m, chain(3, 5))
    assert m.lookup(chain(0, 5)) == 2
    assert m.lookup(chain(3, 5)) == 2
    assert m.lookup([K(99), *chain(0, 2)]) == 0
    assert m.lookup([]) == 0


def test_pinned_blocks_are_not_evicted_and_full_pin_returns_none() -> None:
    m = make(4)
    store(m, chain(0, 4))
    spec = m.prepare_load(chain(0, 4))
    assert spec.slots and set(spec.tiers) == {0}
    # Every block is pinned: no room, None, and nothing changed.
    before = m.stats()
    assert m.prepare_store(chain(10, 11)) is None
    assert m.stats() == before and m.lookup(chain(0, 4)) == 4
    # Unpin two; a store of one block can now evict an unpinned one only.
    m.complete_load(chain(0, 4))
    m.prepare_load(chain(0, 3))
    out = m.prepare_store(chain(10, 11))
    assert out.evicted_keys == (K(3),)
    m.complete_store(out.keys_to_store)
    assert m.lookup(chain(0, 3)) == 3


def test_prepare_load_of_missing_key_pins_nothing() -> None:
    m = make(4)
    store(m, chain(0, 2))
    with pytest.raises(KeyError, match="not ready"):
        m.prepare_load([K(0), K(7)])
    with pytest.raises(KeyError, match="no outstanding load"):
        m.complete_load([K(0)])
    assert m.stats()["t0"]["pinned_blocks"] == 0


def test_duplicate_keys_rejected_without_change() -> None:
    m = make(4)
    with pytest.raises(ValueError, match="duplicates"):
        m.prepare_store([K(1), K(1)])
    assert m.tiers[0].used_blocks == 0


def test_store_larger_than_the_only_tier_keeps_its_head() -> None:
    m = make(3)
    out = m.prepare_store(chain(0, 4))
    # No tier below to write around into: the head, which lookups reach, and nothing else.
    assert out is not None and out.keys_to_store == tuple(chain(0, 3)) and not out.around
    m.complete_store(out.stored_keys)
    assert m.lookup(chain(0, 4)) == 3


def test_write_around_places_what_the_first_tier_cannot_take() -> None:
    m = make(2, 4, 8)
    out = m.prepare_store(chain(0, 10))
    assert out is not None
    # Head into the first tier, then the next tiers in order, each up to its room.
    assert out.keys_to_store == tuple(chain(0, 2))
    assert [(w.spec.tier, w.keys) for w in out.around] == [
        (1, tuple(chain(2, 6))),
        (2, tuple(chain(6, 10))),
    ]
    assert out.stored_keys == tuple(chain(0, 10)) and not out.moves
    assert m.lookup(chain(0, 10)) == 0  # invisible until completed
    m.complete_store(out.stored_keys)
    assert m.lookup(chain(0, 10)) == 10
    assert [m.where(k) for k in chain(0, 10)] == [[0]] * 2 + [[1]] * 4 + [[2]] * 4
    s = m.stats()
    assert (s["t0"]["stored"], s["t1"]["stored"], s["t2"]["stored"]) == (2, 4, 4)


def test_write_around_when_the_first_tier_is_held_by_stores_in_flight() -> None:
    m = make(2, 8)
    first = m.prepare_store(chain(0, 2))  # in flight: its slots are not evictable
    second = m.prepare_store(chain(10, 13))
    assert second is not None and not second.keys_to_store and not second.moves
    assert [(w.spec.tier, w.keys) for w in second.around] == [(1, tuple(chain(10, 13)))]
    m.complete_store(first.stored_keys)
    m.complete_store(second.stored_keys)
    assert m.lookup(chain(10, 13)) == 3 and m.lookup(chain(0, 2)) == 2


def test_write_around_evicts_below_after_the_demotions_it_causes() -> None:
    m = make(2, 3, 8)
    store(m, chain(0, 2))
    store(m, chain(2, 4))  # chain(0, 2) demoted into t1
    out = m.prepare_store(chain(10, 14))
    # t0 makes room by demoting chain(2, 4) into t1 (which demotes into t2 for it); the rest
    # goes around, into t1 as far as its policy frees room, then t2. Moves come first.
    assert out.keys_to_store == tuple(chain(10, 12))
    assert [k for w in out.around for k in w.keys] == chain(12, 14)
    assert {w.spec.tier for w in out.around} <= {1, 2}
    for mv in out.moves:
        m.complete_store(mv.keys)
    m.complete_store(out.stored_keys)
    assert m.lookup(chain(10, 14)) == 4 and m.lookup(chain(0, 4)) == 4
    assert sum(s["used_blocks"] for s in m.stats().values()) == 8


def test_write_through_copies_new_blocks_below_off_the_store_path() -> None:
    tiers = [CPUTier(name=f"t{i}", block_bytes=8, capacity_blocks=c) for i, c in enumerate((4, 8))]
    m = OffloadingManager(
        tiers, [LRUPolicy(4), LRUPolicy(8)], write_through=[False, True], write_through_queue=3
    )
    store(m, chain(0, 4))
    s = m.stats()["t1"]
    # Queued up to the bound; the fourth block is dropped and counted, never waited for.
    assert (s["through_queued"], s["through_dropped"]) == (3, 1)
    moves = m.plan_write_through(limit=2)
    assert [(mv.src.tier, mv.dst.tier, mv.keys) for mv in moves] == [(0, 1, tuple(chain(0, 2)))]
    # The sources are pinned while the copy runs: a store that needs their room evicts others.
    assert m.stats()["t0"]["pinned_blocks"] == 2
    out = m.prepare_store(chain(20, 22))
    assert set(out.evicted_keys) == set(chain(2, 4))
    m.complete_store(out.stored_keys)
    m.complete_write_through(moves[0].keys)
    assert m.stats()["t0"]["pinned_blocks"] == 0
    assert m.where(K(0)) == [0, 1] and m.where(K(1)) == [0, 1]
    s = m.stats()["t1"]
    assert (s["written_through"], s["through_dropped"]) == (2, 1)
    # Blocks written through are not demoted again when they leave the first tier.
    out = m.prepare_store(chain(30, 34))
    assert all(set(mv.keys).isdisjoint(chain(0, 2)) for mv in out.moves)


def test_a_block_moving_when_its_write_through_is_planned_is_copied_once_it_lands() -> None:
    # t0 -> t1 written back, t2 written through: every stored block must reach t2 (a fleet's
    # shared store), however its demotion from t0 and its copy are interleaved.
    caps = (2, 2, 8)
    tiers = [CPUTier(name=f"t{i}", block_bytes=8, capacity_blocks=c) for i, c in enumerate(caps)]
    m = OffloadingManager(
        tiers, [LRUPolicy(2), LRUPolicy(2), LRUPolicy(8)], write_through=[False, False, True]
    )
    store(m, chain(0, 2))  # queued for t2
    # A store evicts both from t0 before their copies are planned: they move into t1.
    out = m.prepare_store(chain(10, 12))
    (mv,) = out.moves
    assert set(mv.keys) == set(chain(0, 2))
    # Planned while they move (ready nowhere): no copy yet, and none given up.
    moves = m.plan_write_through(limit=8)
    assert all(set(w.keys).isdisjoint(chain(0, 2)) for w in moves)
    assert m.stats()["t2"]["through_dropped"] == 0
    m.complete_store(mv.keys)
    m.complete_store(out.keys_to_store)
    # Landed in t1: the copy reads them from there.
    copies = m.plan_write_through(limit=8)
    src = {k: w.src.tier for w in copies for k in w.keys}
    assert src[K(0)] == 1 and src[K(1)] == 1
    m.complete_write_through([k for w in copies for k in w.keys])
    assert 2 in m.where(K(0)) and 2 in m.where(K(1))
    assert m.stats()["t2"]["through_dropped"] == 0


def test_victims_go_past_a_lower_tier_full_of_blocks_in_flight_or_suspended() -> None:
    m = make(2, 2, 8)
    store(m, chain(0, 2))
    # chain(0, 2) leaves t0 for t1; its move is still running: t1 has no slot to give.
    first = m.prepare_store(chain(2, 4))
    (mv,) = first.moves
    assert mv.dst.tier == 1
    m.complete_store(first.keys_to_store)
    # The next victims go on into t2 instead of being dropped (under load, a busy t1 lost
    # the head of a chain this way: it was in no tier afterwards).
    out = m.prepare_store(chain(4, 6))
    assert [(w.src.tier, w.dst.tier, set(w.keys)) for w in out.moves] == [(0, 2, set(chain(2, 4)))]
    for w in (mv, *out.moves):
        m.complete_store(w.keys)
    m.complete_store(out.keys_to_store)
    assert m.stats()["t0"]["dropped"] == 0
    assert [m.where(k) for k in chain(0, 6)] == [[1], [1], [2], [2], [0], [0]]
    # A suspended t1 (it hung) is passed by too: nothing waits on it, nothing is lost.
    m.suspend(1)
    out = store(m, chain(6, 8))
    assert {w.dst.tier for w in out.moves} == {2}
    assert [m.where(k) for k in chain(4, 6)] == [[2], [2]]
    assert m.stats()["t0"]["dropped"] == 0


def test_failed_write_through_frees_its_slot_and_unpins() -> None:
    tiers = [CPUTier(name=f"t{i}", block_bytes=8, capacity_blocks=c) for i, c in enumerate((4, 8))]
    m = OffloadingManager(tiers, [LRUPolicy(4), LRUPolicy(8)], write_through=[False, True])
    store(m, chain(0, 2))
    (mv,) = m.plan_write_through(limit=10)
    m.complete_write_through(mv.keys, success=False)
    s = m.stats()
    assert s["t0"]["pinned_blocks"] == 0 and s["t1"]["used_blocks"] == 0
    assert s["t1"]["through_dropped"] == 2 and m.where(K(0)) == [0]


def test_chain_is_evicted_tail_first() -> None:
    m = make(4)
    store(m, chain(0, 4))
    m.touch(chain(0, 4))
    # Two new blocks evict the chain's tail (3, then 2), never its head.
    out = store(m, chain(10, 12))
    assert set(out.evicted_keys) == {K(2), K(3)}
    assert m.lookup(chain(0, 4)) == 2


def test_demotion_moves_victims_to_next_tier_in_order() -> None:
    m = make(2, 4)
    store(m, chain(0, 2))
    out = m.prepare_store(chain(2, 4))
    # Both victims leave t0 and are planned into t1; the store reuses their slots afterwards.
    assert set(out.evicted_keys) == set(chain(0, 2))
    (mv,) = out.moves
    assert set(mv.keys) == set(chain(0, 2)) and mv.src.tier == 0 and mv.dst.tier == 1
    assert set(mv.src.slots) == set(out.store_spec.slots)
    # While the move is in flight the chain's head reads as "ask again later".
    assert m.lookup(chain(0, 4)) is None
    assert m.lookup_ready(chain(0, 4)) == (0, True)
    assert m.lookup_ready(chain(2, 4)) == (0, False)  # not stored yet: a plain miss
    m.complete_store(mv.keys)
    m.complete_store(out.keys_to_store)
    assert m.lookup(chain(0, 4)) == 4
    assert m.where(K(0)) == [1] and m.where(K(3)) == [0]
    spec = m.prepare_load(chain(0, 4))
    assert [g.tier for g in spec.groups()] == [0, 1]
    m.complete_load(chain(0, 4))
    events = [(e.medium, e.removed, set(e.keys)) for e in m.take_events()]
    assert ("t0", True, set(chain(0, 2))) in events and ("t1", False, set(chain(0, 2))) in events


def test_cascade_lists_deeper_moves_first() -> None:
    m = make(1, 1, 1)
    store(m, [K(0)])
    store(m, [K(1)])  # K0 -> t1
    out = m.prepare_store([K(2)])  # K1 -> t1 needs K0 -> t2 first
    assert [(mv.src.tier, mv.dst.tier) for mv in out.moves] == [(1, 2), (0, 1)]
    assert out.moves[0].keys == (K(0),) and out.moves[1].keys == (K(1),)


def test_last_tier_drops_and_failed_move_loses_block() -> None:
    m = make(1, 1)
    store(m, [K(0)])
    store(m, [K(1)])
    store(m, [K(2)])  # K0 dropped from t1 (last tier), K1 demoted
    assert m.lookup([K(0)]) == 0 and m.lookup([K(1)]) == 1
    assert m.stats()["t1"]["dropped"] == 1
    out = m.prepare_store([K(3)])
    m.complete_store(out.moves[0].keys, success=False)  # the demotion of K2 failed
    m.complete_store(out.keys_to_store)
    assert m.lookup([K(2)]) == 0 and m.lookup([K(3)]) == 1


def test_demotion_skipped_when_lower_tier_holds_copy_and_promotion() -> None:
    m = make(1, 4)
    store(m, [K(0)])
    store(m, [K(1)])  # K0 -> t1
    assert m.where(K(0)) == [1]
    # A hit in t1 can be promoted into t0; the t1 copy stays.
    out = m.prepare_promote([K(0)])
    assert out.keys_to_store == (K(0),) and out.evicted_keys == (K(1),)
    for mv in out.moves:
        m.complete_store(mv.keys)
    m.complete_store(out.keys_to_store)
    assert m.where(K(0)) == [0, 1] and m.where(K(1)) == [1]
    # Evicting K0 from t0 again needs no copy: t1 already holds it.
    out = m.prepare_store([K(5)])
    assert out.evicted_keys == (K(0),) and out.moves == ()
    assert make(1, 4, promote=False).prepare_promote([K(0)]) is None


def test_discard_drops_copy_and_emits_removed() -> None:
    m = make(4)
    store(m, chain(0, 3))
    m.take_events()
    m.prepare_load([K(1)])
    with pytest.raises(ValueError, match="being loaded"):
        m.discard([K(1)])
    m.complete_load([K(1)])
    assert m.discard([K(1)]) == 1
    assert m.lookup(chain(0, 3)) == 1
    (ev,) = m.take_events()
    assert ev.removed and ev.keys == (K(1),)
    assert m.tiers[0].used_blocks == 2 and K(1) not in m.policies[0]


def test_hit_and_miss_counters_per_tier() -> None:
    m = make(2, 4)
    store(m, chain(0, 2))
    store(m, chain(2, 4))  # 0,1 -> t1
    m.lookup([*chain(0, 4), K(9)])
    s = m.stats()
    # Keys 0,1 served by t1 (miss in t0); 2,3 by t0; K9 missed everywhere.
    assert (s["t0"]["hits"], s["t0"]["misses"]) == (2, 3)
    assert (s["t1"]["hits"], s["t1"]["misses"]) == (2, 1)


def test_constructor_validation() -> None:
    t = CPUTier(block_bytes=8, capacity_blocks=2)
    with pytest.raises(ValueError, match="tiers"):
        OffloadingManager([], [])
    with pytest.raises(ValueError, match="policies"):
        OffloadingManager([t], [])


class ManagerMachine(RuleBasedStateMachine):
    """A two-tier manager against a model of what must hold after each step.

    The model tracks per-key intent only (stored, pinned); the invariants check the manager
    never shows a block that is not complete, never evicts a pinned block, keeps capacity, and
    that replaying its events reproduces exactly its per-tier ready sets.
    """

    @initialize(
        policy=st.sampled_from([LRUPolicy, ARCPolicy]),
        cap0=st.integers(1, 4),
        cap1=st.integers(1, 6),
    )
    def start(self, policy, cap0: int, cap1: int) -> None:
        self.m = make(cap0, cap1, policy=policy)
        self.pending: dict[int, tuple] = {}  # id -> PrepareStoreOutput not yet completed
        self.next_id = 0
        self.pins: list[list[bytes]] = []
        self.replayed: dict[str, set[bytes]] = {"t0": set(), "t1": set()}

    keys = st.lists(st.integers(0, 12), min_size=1, max_size=4, unique=True).map(
        lambda xs: [K(x) for x in xs]
    )

    @rule(keys=keys)
    def prepare_store(self, keys) -> None:
        before = self.m.stats()
        pinned = {k for p in self.pins for k in p}
        out = self.m.prepare_store(keys)
        if out is None:
            assert self.m.stats() == before
            return
        assert not set(out.evicted_keys) & pinned
        assert not set(out.evicted_keys) & set(keys)
        self.pending[self.next_id] = out
        self.next_id += 1

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), success=st.booleans())
    def complete(self, data, success: bool) -> None:
        pid = data.draw(st.sampled_from(sorted(self.pending)))
        out = self.pending.pop(pid)
        for mv in out.moves:
            self.m.complete_store(mv.keys, success=data.draw(st.booleans()))
        self.m.complete_store(out.keys_to_store, success=success)
        if success:
            assert self.m.count_ready(out.keys_to_store) == len(out.keys_to_store)

    @rule(keys=keys)
    def load(self, keys) -> None:
        n = self.m.lookup(keys)
        if n:
            spec = self.m.prepare_load(keys[:n])
            assert len(spec.slots) == n
            self.pins.append(keys[:n])

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def finish_load(self, data) -> None:
        i = data.draw(st.integers(0, len(self.pins) - 1))
        self.m.complete_load(self.pins.pop(i))

    @rule(keys=keys)
    def touch(self, keys) -> None:
        self.m.touch(keys)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        for e in self.m.take_events():
            target = self.replayed[e.medium]
            if e.removed:
                assert set(e.keys) <= target
                target -= set(e.keys)
            else:
                assert not set(e.keys) & target
                target |= set(e.keys)
        pinned = {k for p in self.pins for k in p}
        for i, (tier, pol) in enumerate(zip(self.m.tiers, self.m.policies, strict=True)):
            ready = {k for k in self.replayed[tier.medium]}
            assert len(pol) == len(ready) and all(k in pol for k in ready)
            assert tier.used_blocks <= tier.capacity_blocks
            assert all(i in self.m.where(k) for k in ready)
        # Every pinned block is still ready somewhere.
        assert all(self.m.where(k) for k in pinned)
        # `first_tiers` answers as `where` key by key (-1: held nowhere ready), and with
        # `stop` ends at the first key held nowhere.
        keys = [K(i) for i in range(20)]
        fastest = [(self.m.where(k) or [-1])[0] for k in keys]
        assert self.m.first_tiers(keys) == fastest
        assert self.m.first_tiers(keys, stop=True) == fastest[: [*fastest, -1].index(-1)]


ManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestManagerMachine = ManagerMachine.TestCase


class _PersistentPool(CPUTier):
    """A pool tier that claims persistence, to test write-back planning without disk."""

    persistent = True


def test_plan_writeback_copies_volatile_only_blocks_into_free_slots() -> None:
    t0 = CPUTier(name="t0", block_bytes=8, capacity_blocks=4)
    t1 = _PersistentPool(name="p", block_bytes=8, capacity_blocks=3)
    m = OffloadingManager([t0, t1], [LRUPolicy(4), LRUPolicy(3)])
    store(m, chain(0, 4))
    out = store(m, chain(4, 5))
    assert out.evicted_keys == (K(3),)  # the chain's tail went down to p; 0,1,2,4 stay in t0
    moves = m.plan_writeback()
    # p has 2 free slots: the two most recently stored volatile-only blocks go down.
    (mv,) = moves
    assert mv.src.tier == 0 and mv.dst.tier == 1 and mv.keys == (K(4), K(2))
    assert m.lookup([K(4)]) == 1  # still served from t0 meanwhile
    m.complete_store(mv.keys)
    assert m.where(K(4)) == [0, 1] and m.tiers[1].free_blocks == 0
    assert m.plan_writeback() == []  # no room left
    assert make(4).plan_writeback() == []  # no persistent tier


def test_a_move_given_up_reads_as_a_miss_and_still_completes() -> None:
    m = make(2, 4)
    store(m, chain(0, 2))
    out = m.prepare_store(chain(2, 4))
    (mv,) = out.moves
    m.complete_store(out.keys_to_store)
    assert m.lookup(chain(0, 2)) is None and m.is_moving(K(0))
    m.unmove(mv.keys)  # its destination hung past the deadline
    assert m.lookup(chain(0, 2)) == 0 and not m.is_moving(K(0)) and m.is_pending(K(0))
    m.complete_store(mv.keys)  # it lands after all
    assert m.lookup(chain(0, 2)) == 2 and m.where(K(0)) == [1]
    assert m.lookup(chain(2, 4)) == 2
