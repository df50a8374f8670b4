"""Adaptive Replacement Cache (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement
Cache", FAST '03), split into the insert / touch / evict calls of EvictionPolicy.

Primitives: ARCPolicy(capacity) with insert, touch, remove, evict(n, protected), clear, len, in,
keys_in_eviction_order, plus `p` and `state()` (an ARCState snapshot) for tests and metrics.

Lists (each an OrderedDict, least recently used first), with c = capacity:
    T1  resident keys seen once recently         B1  ghosts: keys recently evicted from T1
    T2  resident keys seen at least twice        B2  ghosts: keys recently evicted from T2
    p   target size of T1, adapted in [0, c]

How the paper's cases map onto the calls:
    touch / insert of a resident key  case I: move to the MRU end of T2
    insert of a key in B1 (B2)        case II (III): raise (lower) p, move the key to T2's MRU end
    insert of a new key               case IV: trim the ghost lists as the paper does, put it in T1
    evict                             REPLACE, once per victim, with p as it is now

Deviations, all forced by the split interface: the manager evicts *before* it inserts, so a
ghost hit adapts p after the REPLACE it triggered rather than before; REPLACE's tie-break
"|T1| == p and the incoming key is in B2" is dropped because evict() does not know the incoming
key; and protected keys are skipped, falling back to the other list when the preferred one has no
unprotected key. remove() drops a resident key without leaving a ghost. Ghost lists are trimmed so
that |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c, which is exactly the paper's trimming
while the manager keeps at most c keys resident, and still bounds the ghosts when it does not.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from itertools import filterfalse, islice

from tiercache.policies.base import EvictionPolicy


@dataclass(frozen=True)
class ARCState:
    """A snapshot of ARC's lists (least recently used first) and its target p."""

    t1: tuple[bytes, ...]
    t2: tuple[bytes, ...]
    b1: tuple[bytes, ...]
    b2: tuple[bytes, ...]
    p: float


class ARCPolicy(EvictionPolicy):
    """Balances recency (T1) against frequency (T2), learning the split from ghost hits."""

    def __init__(self, capacity: int) -> None:
        """Create an empty policy for a tier of `capacity` blocks."""
        super().__init__(capacity)
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0

    @property
    def p(self) -> float:
        """The current target size of T1, in [0, capacity]."""
        return self._p

    def state(self) -> ARCState:
        """Copy out all four lists and p."""
        return ARCState(tuple(self._t1), tuple(self._t2), tuple(self._b1), tuple(self._b2), self._p)

    def insert(self, key: bytes) -> None:
        """Add `key`: resident -> touch, ghost -> adapt p and go to T2, new -> T1."""
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if key in t2:  # case I
            t2.move_to_end(key)
        elif key in t1:  # case I
            del t1[key]
            t2[key] = None
        elif key in b1:  # case II: T1 was too small for this key, so grow its target
            delta = 1.0 if len(b1) >= len(b2) else len(b2) / len(b1)
            self._p = min(self._p + delta, float(self.capacity))
            del b1[key]
            t2[key] = None
        elif key in b2:  # case III: T2 was too small for this key, so shrink T1's target
            delta = 1.0 if len(b2) >= len(b1) else len(b1) / len(b2)
            self._p = max(self._p - delta, 0.0)
            del b2[key]
            t2[key] = None
        else:  # case IV
            t1[key] = None
            c = self.capacity  # inline test: trimming is rarely needed and a call costs
            if len(t1) + len(b1) > c or len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
                self._trim_ghosts()

    def insert_many(self, keys: Sequence[bytes], *, new: bool = False) -> None:
        """insert() for each key in order; case IV and its ghost trimming are inlined (the
        manager's batched hot path), the rarer cases go through insert(). A batch of distinct
        keys that none of the four lists holds is all case IV (trimming drops only the oldest
        ghosts, so it cannot change which case a later key falls in): four C-level disjointness
        tests then replace the four membership tests per key."""
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        c, c2 = self.capacity, 2 * self.capacity
        n1, n2, g1, g2 = len(t1), len(t2), len(b1), len(b2)  # list sizes, kept in step
        all_new = (
            len(keys) > 1
            and b1.keys().isdisjoint(keys)
            and b2.keys().isdisjoint(keys)
            and (
                new  # the caller vouches for the rest
                or (
                    t1.keys().isdisjoint(keys)
                    and t2.keys().isdisjoint(keys)
                    and len(set(keys)) == len(keys)
                )
            )
        )
        if all_new:
            # All case IV: append them, then trim once. Trimming only ever drops the oldest
            # ghosts, and T1 only grows meanwhile, so one trim at the end drops exactly the
            # ghosts that trimming after each insert would have dropped.
            for key in keys:
                t1[key] = None
            self._trim_ghosts()
            return
        for key in keys:
            if key in t1 or key in t2 or key in b1 or key in b2:
                self.insert(key)
                n1, n2, g1, g2 = len(t1), len(t2), len(b1), len(b2)
                continue
            t1[key] = None  # case IV, then exactly _trim_ghosts' steps
            n1 += 1
            while g1 and n1 + g1 > c:
                b1.popitem(last=False)
                g1 -= 1
            excess = n1 + n2 + g1 + g2 - c2
            while excess > 0 and (g1 or g2):
                if g2:
                    b2.popitem(last=False)
                    g2 -= 1
                else:
                    b1.popitem(last=False)
                    g1 -= 1
                excess -= 1

    def touch(self, keys: Sequence[bytes]) -> None:
        """Move resident `keys` to T2's MRU end, tail first so the chain head ends up hottest."""
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            if key in t2:
                t2.move_to_end(key)
            elif key in t1:
                del t1[key]
                t2[key] = None

    def remove(self, key: bytes) -> None:
        """Forget a resident key; ghost entries are history and stay."""
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def evict(self, n: int, protected: Container[bytes] = frozenset()) -> list[bytes] | None:
        """Apply REPLACE n times, moving victims to the MRU end of B1 or B2; None if impossible."""
        self._check_count(n)
        plan = self._plan_lists(n, protected)
        if plan is None:
            return None
        first_t1, from_t2, more_t1 = plan
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        # Each victim leaves its list for its ghost list's MRU end, in eviction order, as one
        # REPLACE per victim would; the plan says which list each one is in.
        for key in first_t1:
            del t1[key]
            b1[key] = None
        for key in from_t2:
            del t2[key]
            b2[key] = None
        for key in more_t1:
            del t1[key]
            b1[key] = None
        self._trim_ghosts()  # a no-op unless more than c keys were resident
        return first_t1 + from_t2 + more_t1

    def clear(self) -> None:
        """Forget every key, all ghosts and the learned p."""
        for od in (self._t1, self._t2, self._b1, self._b2):
            od.clear()
        self._p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def keys_in_eviction_order(self) -> Iterator[bytes]:
        """Resident keys in the order successive REPLACE steps would evict them."""
        victims = self._plan(len(self), frozenset())
        assert victims is not None, "evicting every resident key cannot fail"
        return iter(victims)

    def _plan(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        """Pick n victims by REPLACE without mutating anything (so evict can stay atomic)."""
        plan = self._plan_lists(n, protected)
        return None if plan is None else plan[0] + plan[1] + plan[2]

    def _plan_lists(
        self, n: int, protected: Container[bytes]
    ) -> tuple[list[bytes], list[bytes], list[bytes]] | None:
        """The victims of n REPLACE steps, as (from T1, then from T2, then more from T1).

        n successive REPLACE calls with p fixed take T1's LRU key while |T1| > p, which is the
        first |T1| - floor(p) steps, then T2's; skipped protected keys still count in |T1|. When
        the preferred list runs out of unprotected keys the other one is used, so the victims are
        some of T1, then some of T2, then (only if T2 ran dry) more of T1.
        """
        if n > len(self):
            return None
        t1_turns = max(0, len(self._t1) - math.floor(self._p))
        # Unfiltered first: the caller's own keys are rarely among the coldest, and a set
        # tells that in C; filter key by key only when one is.
        k1 = min(n, t1_turns)
        first_t1 = list(islice(self._t1, k1))
        second = list(islice(self._t2, n - k1))
        if len(second) == n - k1 and self._disjoint(protected, first_t1, second):
            return first_t1, second, []
        from_t1: Iterator[bytes] = iter(self._t1)
        from_t2: Iterator[bytes] = iter(self._t2)
        if protected:  # an empty set protects nothing: skip the per-key test
            from_t1 = filterfalse(protected.__contains__, from_t1)
            from_t2 = filterfalse(protected.__contains__, from_t2)
        first_t1 = list(islice(from_t1, min(n, t1_turns)))
        left = n - len(first_t1)
        second = list(islice(from_t2, left)) if left else []
        left -= len(second)
        third = list(islice(from_t1, left)) if left else []
        if left != len(third):
            return None
        return first_t1, second, third

    def _trim_ghosts(self) -> None:
        """Drop the oldest ghosts until |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c: B1's
        first, then B2's (B1's once B2 is empty), counted up front rather than re-tested."""
        t1, b1, b2, c = self._t1, self._b1, self._b2, self.capacity
        n1, g1, g2 = len(t1), len(b1), len(b2)
        drop = min(g1, n1 + g1 - c)
        if drop > 0:
            for _ in range(drop):
                b1.popitem(last=False)
            g1 -= drop
        excess = n1 + len(self._t2) + g1 + g2 - 2 * c
        if excess > 0:
            drop = min(excess, g2)
            for _ in range(drop):
                b2.popitem(last=False)
            for _ in range(min(excess - drop, g1)):
                b1.popitem(last=False)
