"""The eviction-policy contract shared by every tier.

Primitives:
    EvictionPolicy(capacity)  abstract base; capacity is counted in blocks (>= 1)
    on_miss(keys)             the manager is about to store these absent keys (default: no-op)
    insert(key)               add a key as most recently used (idempotent: a present key is touched)
    insert_cold(keys)         add absent keys as the first to evict (copies kept while room allows)
    touch(keys)               mark a prefix chain as used so that its head is evicted last
    remove(key)               forget a resident key (no-op when absent)
    evict(n, protected)       atomically pick and drop n victims, or return None and change nothing
    clear()                   forget everything
    len(p), key in p          resident keys only
    keys_in_eviction_order()  the order evict() would pick victims in (for tests and debugging)

A policy knows opaque hashable keys (16-byte block hashes in practice) and nothing else: no bytes,
tensors or tiers. It does not enforce its capacity on insert; the manager calls evict() first when
the tier is full, and frees the victims itself.
"""

from __future__ import annotations

import copy
import operator
from abc import ABC, abstractmethod
from collections.abc import Container, Iterator, Sequence
from collections.abc import Set as AbstractSet


class EvictionPolicy(ABC):
    """Chooses which resident blocks of one tier to drop when it needs room."""

    def __init__(self, capacity: int) -> None:
        capacity = operator.index(capacity)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity}")
        self.capacity: int = capacity

    def on_miss(self, keys: Sequence[bytes]) -> None:  # noqa: B027 (a no-op hook by design)
        """Learn from a miss before making room for it; the default ignores it.

        Called with the keys the manager is about to store into this tier (distinct, none
        resident, head first), once it knows the room can be made and before evict() and
        insert_many(). The store may still fail and the keys never arrive, so an override
        must not change residency (len, `in`, what evict can pick). ARC adapts p here.
        """

    @abstractmethod
    def insert(self, key: bytes) -> None:
        """Add `key` as most recently used; inserting a resident key behaves like touch([key])."""

    def insert_many(self, keys: Sequence[bytes], *, new: bool = False) -> None:
        """`insert(k)` for each key, in order (once per completed store). `new=True` promises
        the keys are distinct and none is resident (history such as ARC's ghosts may still
        hold them): policies may then skip their per-key residency tests."""
        for key in keys:
            self.insert(key)

    def insert_cold(self, keys: Sequence[bytes]) -> None:
        """Add absent `keys` where evict() picks first: copies this tier keeps only while it
        has room (write-through copies of blocks a faster tier still holds). The default
        inserts them as usual; LRU and ARC put them at their least recently used end."""
        self.insert_many(keys)

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark `keys` (a prefix chain, head first) as used; unknown keys are ignored. Tail
        first, so that the head ends up most recently used and a chain is evicted tail first.
        """

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget a resident key; a key that is not resident is ignored."""

    @abstractmethod
    def evict(self, n: int, protected: Container[bytes] = frozenset()) -> list[bytes] | None:
        """Remove and return exactly `n` victims not in `protected`, in eviction order; None,
        and no state changed, when fewer than `n` can be evicted. n < 0: ValueError."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key (and any history the policy keeps)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is resident (history such as ARC's ghost lists does not count)."""

    def keys_in_eviction_order(self) -> Iterator[bytes]:
        """Resident keys in the order evict() would pick them with nothing protected (the
        default evicts everything from a deep copy; subclasses walk their lists)."""
        victims = copy.deepcopy(self).evict(len(self))
        assert victims is not None, "evicting every resident key cannot fail"
        return iter(victims)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, resident={len(self)})"

    @staticmethod
    def _disjoint(protected: Container[bytes], *victims: list[bytes]) -> bool:
        """Whether no key of `victims` is protected, tested in C when `protected` is a set
        (the manager's case); False when it cannot tell cheaply, so the caller filters."""
        if not protected:
            return True
        # The exact types first: an ABC isinstance check costs more than the test it guards.
        if type(protected) not in (set, frozenset) and not isinstance(protected, AbstractSet):
            return False
        return all(protected.isdisjoint(v) for v in victims)

    @staticmethod
    def _check_count(n: int) -> None:
        """Reject a negative eviction count; shared so every policy words it the same way."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
