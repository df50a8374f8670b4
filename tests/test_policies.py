"""Conformance suite every EvictionPolicy must pass, run once per built-in policy.

A new policy gets the whole contract checked by subclassing PolicyConformance and setting
`policy_cls`; `snapshot` can be overridden to compare richer internal state (ARC's ghosts and p).
"""

from __future__ import annotations

import copy

import pytest

from tiercache.policies import ARCPolicy, EvictionPolicy, LRUPolicy


def key(i: int) -> bytes:
    """A 16-byte block hash, like the ones the manager uses."""
    return i.to_bytes(16, "big")


A, B, C, D, E = (key(i) for i in range(5))


class PolicyConformance:
    policy_cls: type[EvictionPolicy]

    def make(self, capacity: int = 8, keys: tuple[bytes, ...] = ()) -> EvictionPolicy:
        policy = self.policy_cls(capacity)
        for k in keys:
            policy.insert(k)
        return policy

    def snapshot(self, policy: EvictionPolicy) -> object:
        """Everything observable about the policy's state; equal snapshots mean no change."""
        return (len(policy), list(policy.keys_in_eviction_order()))

    def assert_same_state(self, policy: EvictionPolicy, before: EvictionPolicy) -> None:
        """Compare with a deep copy taken earlier, then check both evict identically from here."""
        assert self.snapshot(policy) == self.snapshot(before)
        assert policy.evict(len(policy)) == before.evict(len(before))

    # construction

    @pytest.mark.parametrize("capacity", [0, -1])
    def test_capacity_below_one_is_rejected(self, capacity: int) -> None:
        with pytest.raises(ValueError, match="capacity"):
            self.policy_cls(capacity)

    def test_capacity_is_kept(self) -> None:
        assert self.make(capacity=3).capacity == 3

    # insert / remove / clear / len / contains

    def test_empty_policy(self) -> None:
        policy = self.make()
        assert len(policy) == 0
        assert A not in policy
        assert policy.evict(0) == []
        assert policy.evict(1) is None
        assert list(policy.keys_in_eviction_order()) == []

    def test_insert_makes_keys_resident(self) -> None:
        policy = self.make(keys=(A, B, C))
        assert len(policy) == 3
        assert A in policy and B in policy and C in policy
        assert D not in policy

    def test_insert_of_resident_key_is_idempotent(self) -> None:
        policy = self.make(keys=(A, B))
        policy.insert(A)
        assert len(policy) == 2
        assert sorted(policy.keys_in_eviction_order()) == [A, B]

    def test_remove(self) -> None:
        policy = self.make(keys=(A, B, C))
        policy.remove(B)
        assert len(policy) == 2
        assert B not in policy
        assert policy.evict(2) == [A, C]

    def test_remove_absent_key_is_noop(self) -> None:
        policy = self.make(keys=(A, B))
        before = copy.deepcopy(policy)
        policy.remove(C)
        self.assert_same_state(policy, before)

    def test_remove_then_reinsert(self) -> None:
        policy = self.make(keys=(A, B))
        policy.remove(A)
        policy.insert(A)
        assert len(policy) == 2
        assert A in policy

    def test_clear(self) -> None:
        policy = self.make(keys=(A, B, C))
        policy.evict(1)
        policy.clear()
        assert len(policy) == 0
        assert A not in policy and B not in policy and C not in policy
        assert policy.evict(1) is None
        assert self.snapshot(policy) == self.snapshot(self.make())

    # evict

    def test_evict_returns_exactly_n_and_removes_them(self) -> None:
        policy = self.make(keys=(A, B, C, D))
        victims = policy.evict(2)
        assert victims == [A, B]  # the oldest two, for any sane policy with no history
        assert len(policy) == 2
        assert A not in policy and B not in policy
        assert C in policy and D in policy

    def test_evict_zero_returns_empty_list(self) -> None:
        policy = self.make(keys=(A,))
        assert policy.evict(0) == []
        assert policy.evict(0, protected={A}) == []
        assert len(policy) == 1

    def test_evict_negative_raises(self) -> None:
        policy = self.make(keys=(A,))
        with pytest.raises(ValueError, match="n must be"):
            policy.evict(-1)
        assert len(policy) == 1

    def test_evict_everything(self) -> None:
        policy = self.make(keys=(A, B, C))
        assert sorted(policy.evict(3) or []) == [A, B, C]
        assert len(policy) == 0

    def test_evict_more_than_resident_is_atomic(self) -> None:
        policy = self.make(keys=(A, B, C))
        policy.touch([B])
        before = copy.deepcopy(policy)
        assert policy.evict(4) is None
        self.assert_same_state(policy, before)

    def test_evict_blocked_by_protected_keys_is_atomic(self) -> None:
        policy = self.make(keys=(A, B, C, D))
        policy.touch([A])
        before = copy.deepcopy(policy)
        # Four keys, two protected: only two can go, so asking for three fails and changes nothing.
        assert policy.evict(3, protected={B, D}) is None
        self.assert_same_state(policy, before)

    def test_protected_keys_are_never_evicted(self) -> None:
        policy = self.make(keys=(A, B, C, D, E))
        protected = frozenset({A, C})
        evicted: list[bytes] = []
        while (victims := policy.evict(1, protected)) is not None:
            evicted += victims
        assert sorted(evicted) == [B, D, E]
        assert len(policy) == 2 and A in policy and C in policy

    @pytest.mark.parametrize("container", [set, frozenset, list, tuple, dict.fromkeys])
    def test_protected_accepts_any_container(self, container: type) -> None:
        policy = self.make(keys=(A, B, C))
        assert policy.evict(1, protected=container([A])) == [B]

    def test_evict_order_matches_keys_in_eviction_order(self) -> None:
        policy = self.make(capacity=4, keys=(A, B, C, D))
        policy.touch([C, A])
        order = list(policy.keys_in_eviction_order())
        assert sorted(order) == [A, B, C, D]
        assert [policy.evict(1)[0] for _ in range(4)] == order  # type: ignore[index]

    # touch

    def test_touch_of_unknown_keys_is_ignored(self) -> None:
        policy = self.make(keys=(A, B))
        policy.touch([C, D])
        assert len(policy) == 2 and C not in policy and D not in policy
        assert policy.evict(2) == [A, B]

    def test_touch_of_empty_chain_is_noop(self) -> None:
        policy = self.make(keys=(A, B))
        before = copy.deepcopy(policy)
        policy.touch([])
        self.assert_same_state(policy, before)

    def test_chain_touch_evicts_tail_first(self) -> None:
        policy = self.make(keys=(A, B, C, D))
        policy.touch([A, B, C, D])
        assert policy.evict(4) == [D, C, B, A]

    def test_chain_touch_makes_head_most_recent(self) -> None:
        policy = self.make(keys=(E, A, B, C))
        policy.touch([A, B, C])
        assert policy.evict(4) == [E, C, B, A]

    def test_touched_key_outlives_untouched_ones(self) -> None:
        policy = self.make(keys=(A, B, C))
        policy.touch([A])
        assert policy.evict(2) == [B, C]


class TestLRUConformance(PolicyConformance):
    policy_cls = LRUPolicy


class TestARCConformance(PolicyConformance):
    policy_cls = ARCPolicy

    def snapshot(self, policy: EvictionPolicy) -> object:
        assert isinstance(policy, ARCPolicy)
        return (len(policy), list(policy.keys_in_eviction_order()), policy.state())
