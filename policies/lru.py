"""Least-recently-used eviction on one OrderedDict (least recently used first).

Primitives: LRUPolicy(capacity) with insert, touch, remove, evict(n, protected), clear, len, in,
keys_in_eviction_order. Every operation is O(1) per key except evict, which also walks past
protected keys at the cold end; the hot paths (touch, insert) allocate nothing per call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence
from itertools import filterfalse, islice

from tiercache.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted or touched key first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._od: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        od = self._od
        if key in od:
            od.move_to_end(key)
        else:
            od[key] = None

    def insert_many(self, keys: Sequence[bytes], *, new: bool = False) -> None:
        """insert() for each key in order, in one loop (the manager's batched hot path);
        with `new` (distinct keys, none resident) each key is just appended."""
        od = self._od
        if new:
            if not od:  # a persistent tier's blocks at open: one C call for them all
                self._od = OrderedDict.fromkeys(keys)
                return
            for key in keys:
                od[key] = None
            return
        move_to_end = od.move_to_end
        for key in keys:
            if key in od:
                move_to_end(key)
            else:
                od[key] = None

    def insert_cold(self, keys: Sequence[bytes]) -> None:
        """Absent `keys` at the LRU end, the first of them evicted first."""
        od = self._od
        for key in reversed(keys):
            if key not in od:
                od[key] = None
                od.move_to_end(key, last=False)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Move resident `keys` to the MRU end, tail first so the chain head ends up hottest."""
        od = self._od
        move_to_end = od.move_to_end
        for key in reversed(keys):
            if key in od:
                move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._od.pop(key, None)

    def evict(self, n: int, protected: Container[bytes] = frozenset()) -> list[bytes] | None:
        """Drop and return the `n` least recently used unprotected keys, or None and no change."""
        self._check_count(n)
        od = self._od
        if n > len(od):
            return None
        victims = list(islice(od, n))  # the n coldest keys: right unless one is protected
        if not self._disjoint(protected, victims):
            victims = list(islice(filterfalse(protected.__contains__, od), n))
            if len(victims) < n:
                return None  # nothing was changed yet
        for key in victims:
            del od[key]
        return victims

    def clear(self) -> None:
        self._od.clear()

    def __len__(self) -> int:
        return len(self._od)

    def __contains__(self, key: object) -> bool:
        return key in self._od

    def keys_in_eviction_order(self) -> Iterator[bytes]:
        """Resident keys from least to most recently used."""
        return iter(list(self._od))
