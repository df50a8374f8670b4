"""LRUPolicy against a plain Python list (least recently used first) as the model."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tiercache.policies import LRUPolicy

KEYS = [i.to_bytes(16, "big") for i in range(10)]
keys = st.sampled_from(KEYS)


class LRUAgainstList(RuleBasedStateMachine):
    """Every operation is mirrored on a list; eviction order must match it exactly."""

    @initialize(capacity=st.integers(1, 6))
    def start(self, capacity: int) -> None:
        self.policy = LRUPolicy(capacity)
        self.model: list[bytes] = []

    def _use(self, k: bytes) -> None:
        if k in self.model:
            self.model.remove(k)
        self.model.append(k)

    @rule(k=keys)
    def insert(self, k: bytes) -> None:
        # LRU does not enforce capacity, so inserting past it is allowed and must stay exact.
        self.policy.insert(k)
        self._use(k)

    @rule(chain=st.lists(keys, max_size=6))
    def touch(self, chain: list[bytes]) -> None:
        self.policy.touch(chain)
        for k in reversed(chain):
            if k in self.model:
                self._use(k)

    @rule(k=keys)
    def remove(self, k: bytes) -> None:
        self.policy.remove(k)
        if k in self.model:
            self.model.remove(k)

    @rule(n=st.integers(0, 8), protected=st.frozensets(keys, max_size=5))
    def evict(self, n: int, protected: frozenset[bytes]) -> None:
        candidates = [k for k in self.model if k not in protected]
        expected = candidates[:n] if len(candidates) >= n else None
        assert self.policy.evict(n, protected) == expected
        for k in expected or ():
            self.model.remove(k)

    @rule()
    def clear(self) -> None:
        self.policy.clear()
        self.model.clear()

    @invariant()
    def matches_model(self) -> None:
        assert len(self.policy) == len(self.model)
        assert list(self.policy.keys_in_eviction_order()) == self.model
        assert all(k in self.policy for k in self.model)


TestLRUAgainstList = LRUAgainstList.TestCase
TestLRUAgainstList.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_evict_skips_protected_keys_at_the_cold_end() -> None:
    policy = LRUPolicy(4)
    for k in KEYS[:4]:
        policy.insert(k)
    # The two coldest keys are pinned (say, being loaded); the next two go instead, coldest first.
    assert policy.evict(2, protected={KEYS[0], KEYS[1]}) == [KEYS[2], KEYS[3]]
    assert list(policy.keys_in_eviction_order()) == KEYS[:2]
