"""ARCPolicy against a literal transcription of the paper, plus its invariants and scenarios.

ReferenceARC follows Megiddo & Modha (FAST '03), Fig. 4, with plain lists (LRU first) and no
optimisation, split the way the manager drives a policy: on_miss(keys) runs the start of cases
II and III (adapt p) for each key of a store, head first, before the eviction that makes room
for them; evict(n) then runs REPLACE once per key for the last n of those keys, |T1| counting
the keys ahead of it, each of which the paper would already have put in T1; insert() finishes
cases I-IV. The documented deviations in policies/arc.py are transcribed too: one 2c
directory bound trimmed from the longer ghost list (no |L1| <= c rule), ghost hits waiting in
`pending` (at most c) until their store completes, every batch key counted as landing in T1
(no B2 tie-break), and REPLACE with no preceding on_miss taking T1 while |T1| > p. The state
machine plays the manager and never lets more than c keys be resident.
"""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiercache.manager import OffloadingManager
from tiercache.policies import ARCPolicy, EvictionPolicy, LRUPolicy
from tiercache.tiers.cpu import CPUTier

KEYS = [i.to_bytes(16, "big") for i in range(12)]
keys = st.sampled_from(KEYS)


class ReferenceARC:
    """ARC(c) from the paper: T1, T2, B1, B2 as lists, LRU first, and the target p."""

    def __init__(self, c: int) -> None:
        self.c = c
        self.p: float = 0
        self.t1: list[bytes] = []
        self.t2: list[bytes] = []
        self.b1: list[bytes] = []
        self.b2: list[bytes] = []
        self.pending: list[bytes] = []  # ghost hits whose p was adapted, store in flight
        self.batch = 0  # keys of the last on_miss, whose eviction has not run yet

    def on_miss(self, keys: list[bytes]) -> None:
        self.batch = len(keys)
        for x in keys:
            if x in self.b1:  # Case II: p = min(p + delta1, c); x leaves B1 for T2 (pending)
                self.p = min(self.p + max(len(self.b2) / len(self.b1), 1), self.c)
                self.b1.remove(x)
                self.pending.append(x)
            elif x in self.b2:  # Case III: p = max(p - delta2, 0); x leaves B2 for T2 (pending)
                self.p = max(self.p - max(len(self.b1) / len(self.b2), 1), 0)
                self.b2.remove(x)
                self.pending.append(x)
            if len(self.pending) > self.c:
                del self.pending[0]

    def insert(self, x: bytes) -> None:
        if x in self.t1 or x in self.t2:  # Case I: a hit moves x to the MRU end of T2
            self.touch([x])
        elif x in self.pending:  # Case II or III, p adapted in on_miss: x goes to T2's MRU end
            self.pending.remove(x)
            self.t2.append(x)
            self.trim(2 * self.c)  # it left its ghost list in on_miss
        elif x in self.b1:  # Case II without on_miss: p = min(p + delta1, c), x to T2
            self.p = min(self.p + max(len(self.b2) / len(self.b1), 1), self.c)
            self.b1.remove(x)
            self.t2.append(x)
        elif x in self.b2:  # Case III without on_miss: p = max(p - delta2, 0), x to T2
            self.p = max(self.p - max(len(self.b1) / len(self.b2), 1), 0)
            self.b2.remove(x)
            self.t2.append(x)
        else:  # Case IV: while the directory is full, drop the longer ghost list's LRU
            self.trim(2 * self.c - 1)
            self.t1.append(x)

    def insert_many(self, keys: list[bytes]) -> None:
        self.batch = 0  # the store the batch described has completed
        for x in keys:
            self.insert(x)

    def trim(self, limit: int) -> None:
        while len(self.t1 + self.t2 + self.b1 + self.b2) > limit and (self.b1 or self.b2):
            del (self.b1 if len(self.b1) > len(self.b2) else self.b2)[0]

    def touch(self, chain: list[bytes]) -> None:
        for x in reversed(chain):
            for lst in (self.t1, self.t2):
                if x in lst:
                    lst.remove(x)
                    self.t2.append(x)

    def remove(self, x: bytes) -> None:
        for lst in (self.t1, self.t2, self.pending):
            if x in lst:
                lst.remove(x)

    def clear(self) -> None:
        self.__init__(self.c)  # type: ignore[misc]

    def evict(self, n: int, protected: frozenset[bytes]) -> list[bytes] | None:
        """REPLACE n times on copies; commit them only if all n victims were found."""
        t1, t2, b1, b2 = list(self.t1), list(self.t2), list(self.b1), list(self.b2)
        batch = n <= self.batch  # REPLACE for the batch's last n keys, each landing in T1
        # Its first batch - n keys landed in free slots; without a batch nothing lands.
        size_t1 = len(t1) + (self.batch - n if batch else 0)
        victims = []
        for _ in range(n):
            # REPLACE: T1's LRU if |T1| >= 1 and |T1| > p, else T2's, skipping protected keys
            # and falling back to the other list when the preferred one has nothing evictable.
            from_t1 = size_t1 >= 1 and size_t1 > self.p
            order = [(t1, b1), (t2, b2)] if from_t1 else [(t2, b2), (t1, b1)]
            for resident, ghost in order:
                candidates = [k for k in resident if k not in protected]
                if candidates:
                    resident.remove(candidates[0])
                    ghost.append(candidates[0])
                    victims.append(candidates[0])
                    size_t1 -= resident is t1
                    break
            else:
                return None
            size_t1 += batch  # x itself now lands in T1
        self.t1, self.t2, self.b1, self.b2 = t1, t2, b1, b2
        self.trim(2 * self.c)
        self.batch = 0
        return victims


def check_bounds(policy: ARCPolicy) -> None:
    """The paper's invariants, for a policy that never holds more than c keys."""
    s, c = policy.state(), policy.capacity
    assert len(s.t1) + len(s.t2) == len(policy) <= c
    assert len(s.t1) + len(s.t2) + len(s.b1) + len(s.b2) <= 2 * c
    assert len(s.pending) <= c
    assert 0 <= s.p <= c
    lists = s.t1 + s.t2 + s.b1 + s.b2 + s.pending
    assert len(set(lists)) == len(lists)  # disjoint
    assert all(k not in policy for k in s.b1 + s.b2 + s.pending)  # not resident


class ARCAgainstReference(RuleBasedStateMachine):
    """Every call is mirrored on ReferenceARC: victims, all four lists and p must agree."""

    @initialize(capacity=st.integers(1, 6))
    def start(self, capacity: int) -> None:
        self.policy = ARCPolicy(capacity)
        self.ref = ReferenceARC(capacity)

    @rule(k=keys)
    def insert(self, k: bytes) -> None:
        # Like the manager: make room first when a new key would not fit.
        if k not in self.policy and len(self.policy) == self.policy.capacity:
            assert self.policy.evict(1) == self.ref.evict(1, frozenset())
        self.policy.insert(k)
        self.ref.insert(k)

    @rule(chain=st.lists(keys, max_size=8, unique=True), completes=st.booleans())
    def store(self, chain: list[bytes], completes: bool) -> None:
        # Like prepare_store: on_miss with the absent keys, then evict for room (the chain is
        # protected); a refused or failed store never inserts, so pending ghost hits linger.
        new = [k for k in chain if k not in self.policy]
        self.policy.on_miss(new)
        self.ref.on_miss(new)
        need = len(new) - (self.policy.capacity - len(self.policy))
        if need > 0:
            victims = self.policy.evict(need, frozenset(chain))
            assert victims == self.ref.evict(need, frozenset(chain))
            if victims is None:
                return
        if completes:  # complete_store inserts tail first, so the chain's head ends up MRU
            self.policy.insert_many(new[::-1])
            self.ref.insert_many(new[::-1])

    @rule(chain=st.lists(keys, max_size=6))
    def touch(self, chain: list[bytes]) -> None:
        self.policy.touch(chain)
        self.ref.touch(chain)

    @rule(k=keys)
    def remove(self, k: bytes) -> None:
        self.policy.remove(k)
        self.ref.remove(k)

    @rule()
    def clear(self) -> None:
        self.policy.clear()
        self.ref.clear()

    @rule(n=st.integers(0, 7), protected=st.frozensets(keys, max_size=6))
    def evict(self, n: int, protected: frozenset[bytes]) -> None:
        assert self.policy.evict(n, protected) == self.ref.evict(n, protected)

    @precondition(lambda self: len(self.policy) > 0)
    @rule(data=st.data())
    def evict_all_but_protected(self, data: st.DataObject) -> None:
        # Exactly as many as are unprotected: the boundary between success and None.
        protected = data.draw(st.frozensets(keys, max_size=6))
        n = sum(k not in protected for k in self.ref.t1 + self.ref.t2)
        assert self.policy.evict(n, protected) == self.ref.evict(n, protected)

    @invariant()
    def same_state_as_reference(self) -> None:
        s = self.policy.state()
        assert (list(s.t1), list(s.t2), list(s.b1), list(s.b2), list(s.pending)) == (
            self.ref.t1,
            self.ref.t2,
            self.ref.b1,
            self.ref.b2,
            self.ref.pending,
        )
        # keys_in_eviction_order is what evict(len) would do next, batch included.
        order = copy.deepcopy(self.ref).evict(len(self.policy), frozenset())
        assert list(self.policy.keys_in_eviction_order()) == order
        assert s.p == self.ref.p
        check_bounds(self.policy)


TestARCAgainstReference = ARCAgainstReference.TestCase
TestARCAgainstReference.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


class ARCOverCapacity(RuleBasedStateMachine):
    """A careless caller that inserts past capacity: ghosts stay bounded, eviction stays sound."""

    @initialize(capacity=st.integers(1, 4))
    def start(self, capacity: int) -> None:
        self.policy = ARCPolicy(capacity)

    @rule(k=keys)
    def insert(self, k: bytes) -> None:
        self.policy.insert(k)

    @rule(chain=st.lists(keys, max_size=6))
    def touch(self, chain: list[bytes]) -> None:
        self.policy.touch(chain)

    @rule(n=st.integers(0, 7))
    def evict(self, n: int) -> None:
        order = list(self.policy.keys_in_eviction_order())
        assert self.policy.evict(n) == (order[:n] if n <= len(order) else None)

    @rule(n=st.integers(0, 7), protected=st.frozensets(keys, max_size=4))
    def evict_protected(self, n: int, protected: frozenset[bytes]) -> None:
        resident = set(self.policy.keys_in_eviction_order())
        victims = self.policy.evict(n, protected)
        if len(resident - protected) < n:
            assert victims is None
            assert set(self.policy.keys_in_eviction_order()) == resident
        else:
            assert victims is not None and len(set(victims)) == n
            assert set(victims) <= resident - protected
            assert set(self.policy.keys_in_eviction_order()) == resident - set(victims)

    @invariant()
    def bounded(self) -> None:
        s, c = self.policy.state(), self.policy.capacity
        assert len(s.t1) + len(s.t2) == len(self.policy)
        assert len(s.b1) + len(s.b2) <= max(0, 2 * c - len(self.policy))
        assert 0 <= s.p <= c


TestARCOverCapacity = ARCOverCapacity.TestCase
TestARCOverCapacity.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


# Unit tests for the adaptive part.


def test_new_key_goes_to_t1_and_a_hit_promotes_it_to_t2() -> None:
    policy = ARCPolicy(4)
    policy.insert(KEYS[0])
    assert policy.state().t1 == (KEYS[0],)
    policy.touch([KEYS[0]])
    assert policy.state().t1 == () and policy.state().t2 == (KEYS[0],)


def test_b1_ghost_hit_raises_p_and_b2_ghost_hit_lowers_it() -> None:
    policy = ARCPolicy(2)
    a, b = KEYS[:2]
    policy.insert(a)
    policy.insert(b)
    assert policy.evict(1) == [a]  # |T1| = 2 > p = 0: T1's LRU goes to the ghost list B1
    assert policy.state().b1 == (a,)
    policy.insert(a)  # B1 ghost hit: recency was undervalued, so p grows by 1
    assert policy.p == 1 and policy.state().t2 == (a,) and policy.state().b1 == ()
    policy.touch([b])  # T1 = [], T2 = [a, b]: |T1| = 0 <= p, so T2 is the victim list
    assert policy.evict(1) == [a]
    assert policy.state().b2 == (a,)
    policy.insert(a)  # B2 ghost hit: frequency was undervalued, so p shrinks back to 0
    assert policy.p == 0 and policy.state().t2 == (b, a)


def test_p_moves_by_the_ghost_size_ratio() -> None:
    policy = ARCPolicy(3)
    a, b, c, d = KEYS[:4]
    for k in (a, b, c):
        policy.insert(k)
    policy.touch([a, b, c])  # T2 = [c, b, a]
    assert policy.evict(2) == [c, b]  # |T1| = 0 <= p: from T2, so B2 = [c, b]
    policy.insert(d)  # T1 = [d]
    assert policy.evict(1) == [d]  # |T1| = 1 > p = 0: B1 = [d]
    policy.insert(d)  # B1 hit with |B2| / |B1| = 2 / 1: p grows by 2, not 1
    assert policy.p == 2
    policy.insert(c)  # B2 hit with |B1| = 0 <= |B2|: p shrinks by 1
    assert policy.p == 1


def test_evict_compares_t1_with_a_fractional_p() -> None:
    policy = ARCPolicy(5)
    k = KEYS
    for key in k[:3]:
        policy.insert(key)
    policy.touch(k[:3])
    assert policy.evict(3) == [k[2], k[1], k[0]]  # T2's keys become the ghosts B2 = [k2, k1, k0]
    policy.insert(k[3])
    policy.insert(k[4])
    assert policy.evict(2) == [k[3], k[4]]  # T1's keys become the ghosts B1 = [k3, k4]
    policy.insert(k[3])  # B1 hit with |B2| / |B1| = 3 / 2: p = 1.5, and k3 goes to T2
    assert policy.p == 1.5
    policy.insert(k[5])
    policy.insert(k[6])  # T1 = [k5, k6], T2 = [k3]
    # |T1| = 2 > 1.5 picks T1 once; then |T1| = 1 <= 1.5 picks T2.
    assert policy.evict(2) == [k[5], k[3]]


def test_remove_leaves_no_ghost_and_clear_resets_p() -> None:
    policy = ARCPolicy(2)
    for k in KEYS[:2]:
        policy.insert(k)
    policy.remove(KEYS[0])
    assert policy.state().b1 == ()
    policy.evict(1)
    policy.insert(KEYS[1])  # ghost hit, p > 0
    assert policy.p > 0
    policy.clear()
    assert policy.state() == ARCPolicy(2).state()


def run_stores(arc: EvictionPolicy) -> list[tuple[bytes, ...]]:
    """Through the manager (on_miss in prepare_store, before it evicts): the victims of each
    store in a scenario where a batch's new keys change what the paper's REPLACE picks."""
    a, b, c, d, e, f, g, h, i = KEYS[:9]
    m = OffloadingManager([CPUTier(block_bytes=1, capacity_blocks=4, pin_memory=False)], [arc])

    def store(*ks: bytes) -> tuple[bytes, ...]:
        out = m.prepare_store(ks)
        assert out is not None
        m.complete_store(out.keys_to_store)
        return out.evicted_keys

    got = [store(a, b, c, d)]
    m.touch([d])  # T1 = [c, b, a], T2 = [d]
    got.append(store(e, f))  # |T1| = 3 > p = 0: T1's LRU keys become the ghosts B1 = [c, b]
    got.append(store(c, b))  # two B1 ghost hits: p = 2; both go to T2, so T1 = [e]
    got.append(store(g, h, i))
    return got


def test_a_batch_evicts_in_the_papers_per_key_order() -> None:
    a, b, c, d, e, f = KEYS[:6]
    arc = ARCPolicy(4)
    got = run_stores(arc)
    assert got[:3] == [(), (c, b), (a, f)]
    # T1 = [e], T2 = [d, b, c], p = 2, and three new keys need three slots. The paper runs
    # REPLACE per key: |T1| = 1 <= p takes T2's LRU (d) and g lands in T1; |T1| = 2 <= p takes
    # T2's next (b) and h lands; |T1| = 3 > p takes T1's LRU (e). The ARC before on_miss
    # (|T1| + |B1| <= c, which had dropped c from B1 so p was 1; all three victims picked with
    # p fixed, T1 while |T1| > p) took (e, d, b): checked by running this on it.
    assert got[3] == (d, b, e)
    s = arc.state()
    assert s.p == 2 and s.t2 == (c,) and s.pending == ()


def test_ghost_hits_wait_in_pending_and_failed_stores_leave_bounded_state() -> None:
    a, b, c = KEYS[:3]
    policy = ARCPolicy(2)
    policy.insert_many([a, b])
    policy.touch([b])  # T1 = [a], T2 = [b]
    policy.on_miss([c])
    assert policy.evict(1) == [a]  # |T1| = 1 > p = 0 (T1 counts no arrival before c)
    policy.insert(c)  # T1 = [c], T2 = [b], B1 = [a]
    policy.on_miss([a])  # B1 hit: p = 1; a is pending until its store completes
    assert policy.p == 1 and policy.state().pending == (a,) and a not in policy
    assert policy.evict(1) == [b]  # |T1| = 1 == p, and a was in B1, not B2: T2 goes
    policy.on_miss([b])  # B2 hit: p = 0; |T1| = 1 > 0: T1 goes
    assert policy.p == 0 and policy.evict(1) == [c]
    # Neither store completes (both fail): the pending entries stay bounded by c, never count
    # as resident, and remove() or clear() drop them.
    assert len(policy) == 0 and policy.state().pending == (a, b)
    policy.remove(a)
    assert policy.state().pending == (b,)
    policy.clear()
    assert policy.state() == ARCPolicy(2).state()


# Scenario: a hot working set that fits, polluted by a one-off scan.


def hit_rate(policy: EvictionPolicy, trace: list[bytes]) -> float:
    """Replay `trace` through a minimal cache: hit -> touch; miss -> make room, then insert."""
    hits = 0
    for k in trace:
        if k in policy:
            hits += 1
            policy.touch([k])
        else:
            if len(policy) == policy.capacity:
                assert policy.evict(1) is not None
            policy.insert(k)
    return hits / len(trace)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arc_resists_a_scan_that_flushes_lru(seed: int) -> None:
    rng = random.Random(seed)
    hot = [b"hot" + i.to_bytes(13, "big") for i in range(80)]  # 80 keys: fits in 100 blocks
    cold = (b"cold" + i.to_bytes(12, "big") for i in range(10**6))  # each used exactly once
    trace: list[bytes] = []
    # Step 1, warm-up: three passes over the hot set, so ARC sees every hot key twice or more
    # and keeps it in T2 (frequency), while LRU simply holds all 80.
    for _ in range(3):
        trace += rng.sample(hot, len(hot))
    # Step 2, the scan: random hot reads interleaved one-for-one with never-repeated cold keys.
    # Between two reads of a hot key LRU sees ~80 cold keys plus ~50 distinct hot ones, more
    # than its 100 blocks, so the scan keeps flushing the hot set. ARC parks the cold keys in
    # T1 (|T1| > p, since no cold key ever comes back to raise p) and evicts them first.
    for _ in range(2000):
        trace.append(rng.choice(hot))
        trace.append(next(cold))
    # Step 3, replay the same trace through both policies with the same 100-block capacity.
    lru, arc = hit_rate(LRUPolicy(100), trace), hit_rate(ARCPolicy(100), trace)
    # Step 4, ARC should hit on nearly every hot read (about half the trace), LRU on far fewer.
    assert arc > lru + 0.15, (arc, lru)
    assert arc > 0.45
