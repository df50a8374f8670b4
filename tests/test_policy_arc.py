"""ARCPolicy against a literal transcription of the paper, plus its invariants and a scenario.

ReferenceARC follows Megiddo & Modha (FAST '03), Fig. 4, with plain lists (LRU first) and no
optimisation. REPLACE runs in evict(), as in ARCPolicy, because the manager evicts before it
inserts; the state machine plays the manager and never lets more than c keys be resident.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiercache.policies import ARCPolicy, EvictionPolicy, LRUPolicy

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

    def insert(self, x: bytes) -> None:
        if x in self.t1 or x in self.t2:  # Case I: a hit moves x to the MRU end of T2
            self.touch([x])
        elif x in self.b1:  # Case II: p = min(p + delta1, c), then x goes to the MRU end of T2
            self.p = min(self.p + max(len(self.b2) / len(self.b1), 1), self.c)
            self.b1.remove(x)
            self.t2.append(x)
        elif x in self.b2:  # Case III: p = max(p - delta2, 0), then x goes to the MRU end of T2
            self.p = max(self.p - max(len(self.b1) / len(self.b2), 1), 0)
            self.b2.remove(x)
            self.t2.append(x)
        else:  # Case IV
            l1 = len(self.t1) + len(self.b1)
            total = l1 + len(self.t2) + len(self.b2)
            if l1 == self.c:  # Case A
                assert len(self.t1) < self.c, "the manager evicts before inserting"
                del self.b1[0]
            elif total == 2 * self.c:  # Case B (|L1| < c and the directory is full)
                del self.b2[0]
            self.t1.append(x)

    def touch(self, chain: list[bytes]) -> None:
        for x in reversed(chain):
            for lst in (self.t1, self.t2):
                if x in lst:
                    lst.remove(x)
                    self.t2.append(x)

    def remove(self, x: bytes) -> None:
        for lst in (self.t1, self.t2):
            if x in lst:
                lst.remove(x)

    def evict(self, n: int, protected: frozenset[bytes]) -> list[bytes] | None:
        """REPLACE n times on copies; commit them only if all n victims were found."""
        t1, t2, b1, b2 = list(self.t1), list(self.t2), list(self.b1), list(self.b2)
        victims = []
        for _ in range(n):
            # REPLACE: take T1's LRU if |T1| > p, else T2's, skipping protected keys and falling
            # back to the other list when the preferred one has nothing evictable.
            order = [(t1, b1), (t2, b2)] if len(t1) > self.p else [(t2, b2), (t1, b1)]
            for resident, ghost in order:
                candidates = [k for k in resident if k not in protected]
                if candidates:
                    resident.remove(candidates[0])
                    ghost.append(candidates[0])
                    victims.append(candidates[0])
                    break
            else:
                return None
        self.t1, self.t2, self.b1, self.b2 = t1, t2, b1, b2
        return victims


def check_bounds(policy: ARCPolicy) -> None:
    """The paper's invariants, for a policy that never holds more than c keys."""
    s, c = policy.state(), policy.capacity
    assert len(s.t1) + len(s.t2) == len(policy) <= c
    assert len(s.t1) + len(s.b1) <= c
    assert len(s.t1) + len(s.t2) + len(s.b1) + len(s.b2) <= 2 * c
    assert 0 <= s.p <= c
    assert len(set(s.t1 + s.t2 + s.b1 + s.b2)) == len(s.t1 + s.t2 + s.b1 + s.b2)  # disjoint
    assert all(k not in policy for k in s.b1 + s.b2)  # ghosts are not resident


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

    @rule(chain=st.lists(keys, max_size=6))
    def touch(self, chain: list[bytes]) -> None:
        self.policy.touch(chain)
        self.ref.touch(chain)

    @rule(k=keys)
    def remove(self, k: bytes) -> None:
        self.policy.remove(k)
        self.ref.remove(k)

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
        assert (list(s.t1), list(s.t2), list(s.b1), list(s.b2)) == (
            self.ref.t1,
            self.ref.t2,
            self.ref.b1,
            self.ref.b2,
        )
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
        assert len(s.b1) <= max(0, c - len(s.t1))
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
