"""Adaptive Replacement Cache (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement
Cache", FAST '03), split into the on_miss / insert / touch / evict calls of EvictionPolicy.

Primitives: ARCPolicy(capacity) with on_miss, insert, touch, remove, evict(n, protected), clear,
len, in, keys_in_eviction_order, plus `p` and `state()` (an ARCState snapshot) for tests and
metrics.

Lists (each an OrderedDict, least recently used first), with c = capacity:
    T1  resident keys seen once recently         B1  ghosts: keys recently evicted from T1
    T2  resident keys seen at least twice        B2  ghosts: keys recently evicted from T2
    p   target size of T1, adapted in [0, c]     pending: ghost hits counted, store in flight

How the paper's cases map onto the manager's calls (prepare_store: on_miss, then evict for
room; complete_store: insert_many):
    touch / insert of a resident key  case I: move to the MRU end of T2
    on_miss of a key in B1 (B2)       case II (III): raise (lower) p, the ghost becomes pending
    insert of a pending key           ... and goes to T2's MRU end when its store completes
    insert of a new key               case IV: put it at T1's MRU end, trim the ghosts
    evict(n) after on_miss(keys)      REPLACE for the last n of the keys, each then landing in T1
    evict(n) without on_miss          REPLACE n times with p as it is now

The manager stores a whole miss suffix at once, and the paper handles a request's misses one
key at a time: each new key that needs room runs REPLACE and then lands in T1, so a batch of
new keys refills T1 as it evicts. on_miss(keys) therefore adapts p for the batch's ghost hits
first (cases II and III, head first, with |B1| and |B2| as they are at that step) and
remembers the batch's size k; evict(n) then runs REPLACE for the batch's last n keys (the
first k - n fit in free slots) with that p, |T1| counting the k - n keys ahead of them and one
more after each step: T2's LRU while |T1| <= p, T1's once |T1| > p (|T1| then stays put, one
out and one in). Without a batch (lower tiers, whose stores are demotions, and direct callers)
evict does n REPLACEs with nothing arriving in between: T1 while |T1| > p, then T2.

Deviations, and why:
- Ghost bound: the paper keeps |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (its
  case IV deletes B1's LRU when |L1| = c, else B2's). Here only the 2c directory bound holds,
  and the longer ghost list gives up its LRU entry (B2 on a tie). With prefix chains T1 swings
  by a whole request at a time, and the L1 rule then empties B1 exactly when the next returning
  chain would hit it (vLLM's ARC, which keeps up to c in each ghost list, has no L1 rule either).
- A ghost hit counted by on_miss leaves its ghost list at once (the paper moves it to T2 in
  the same step) and waits in `pending` until its store completes. A store that fails or is
  refused never inserts it: the entry is dropped by remove(key) or clear(), and otherwise
  `pending` keeps at most c entries, the oldest going first (a forgotten one, if its store
  does complete, enters T1 as a new key). Residency never depends on `pending`.
- Every key of an on_miss batch counts as landing in T1, ghost hits too (they go to T2): the
  eviction then has one closed form, and with prefix chains a batch holds few ghost hits.
  The paper's tie-break (T1 when |T1| == p and the incoming key is in B2) is dropped with it.
- The batch that on_miss describes is used by the next successful evict only, and dropped by
  it, by the next on_miss, by insert_many or by clear(); a stale one changes only which list
  a later eviction prefers, never its atomicity.
- Protected keys are skipped, falling back to the other list when the preferred one has no
  unprotected key; skipped keys still count in |T1|.
- insert() of a ghost key that on_miss did not see (a lower tier, a direct caller) adapts p
  after the eviction it caused. remove() leaves no ghost.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass
from itertools import filterfalse, islice

from tiercache.policies.base import EvictionPolicy

# Victims as runs, in eviction order: (keys, taken from T1).
_Plan = list[tuple[list[bytes], bool]]


@dataclass(frozen=True)
class ARCState:
    """A snapshot of ARC's lists (least recently used first), its target p and the pending
    ghost hits (counted by on_miss, store not yet completed)."""

    t1: tuple[bytes, ...]
    t2: tuple[bytes, ...]
    b1: tuple[bytes, ...]
    b2: tuple[bytes, ...]
    p: float
    pending: tuple[bytes, ...] = ()
    cold: tuple[bytes, ...] = ()


class ARCPolicy(EvictionPolicy):
    """Balances recency (T1) against frequency (T2), learning the split from ghost hits."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._pending: dict[bytes, None] = {}
        # insert_cold: copies kept while room allows, evicted before any REPLACE, outside
        # T1/T2/p and the ghost lists (they never were a miss or a hit of this tier).
        self._cold: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0
        self._batch = 0  # keys in the last on_miss batch, 0 when there is none

    @property
    def p(self) -> float:
        """The current target size of T1, in [0, capacity]."""
        return self._p

    def state(self) -> ARCState:
        """Copy out all four lists, p and the pending ghost hits."""
        return ARCState(
            tuple(self._t1),
            tuple(self._t2),
            tuple(self._b1),
            tuple(self._b2),
            self._p,
            tuple(self._pending),
            tuple(self._cold),
        )

    def on_miss(self, keys: Sequence[bytes]) -> None:
        """Cases II and III before REPLACE: adapt p for each ghost key, head first; remember
        how many keys arrive, for the eviction that makes room for them."""
        b1, b2 = self._b1, self._b2
        self._batch = len(keys)
        if (not b1 or b1.keys().isdisjoint(keys)) and (not b2 or b2.keys().isdisjoint(keys)):
            return  # the common case: no ghost hit, p stays
        c, pending = self.capacity, self._pending
        for key in keys:
            if key in b1 or key in b2:
                self._adapt(key)
                pending[key] = None
                if len(pending) > c:  # bounded even if stores keep failing
                    del pending[next(iter(pending))]

    def _adapt(self, key: bytes) -> None:
        """Cases II and III for a ghost key: adapt p by the paper's delta and take the key off
        its ghost list (where it goes next is the caller's: pending, or T2)."""
        b1, b2 = self._b1, self._b2
        if key in b1:  # case II: T1 was too small for this key, so grow its target
            delta = 1.0 if len(b1) >= len(b2) else len(b2) / len(b1)
            self._p = min(self._p + delta, float(self.capacity))
            del b1[key]
        else:  # case III: T2 was too small for this key, so shrink T1's target
            delta = 1.0 if len(b2) >= len(b1) else len(b1) / len(b2)
            self._p = max(self._p - delta, 0.0)
            del b2[key]

    def insert(self, key: bytes) -> None:
        """Add `key`: resident -> touch, pending or ghost -> T2 (a ghost adapts p), new -> T1."""
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if self._cold and self._cold.pop(key, 0) is None:
            t1[key] = None  # a cold copy in use now: as a new key
            return
        if key in t2:  # case I
            t2.move_to_end(key)
        elif key in t1:  # case I
            del t1[key]
            t2[key] = None
        elif key in self._pending:  # case II or III, p already adapted by on_miss
            del self._pending[key]
            t2[key] = None  # it left its ghost list in on_miss: the directory may be over 2c
            if len(t1) + len(t2) + len(b1) + len(b2) > 2 * self.capacity:
                self._trim_ghosts()
        elif key in b1 or key in b2:  # case II or III without on_miss
            self._adapt(key)
            t2[key] = None
        else:  # case IV
            t1[key] = None
            # inline test: trimming is rarely needed and a call costs
            if len(t1) + len(t2) + len(b1) + len(b2) > 2 * self.capacity:
                self._trim_ghosts()

    def insert_many(self, keys: Sequence[bytes], *, new: bool = False) -> None:
        """insert() for each key in order; the rarer cases go through insert(). A batch of
        distinct keys that none of the lists (nor pending) holds is all case IV: C-level
        disjointness tests replace the membership tests per key (with `new`, the caller
        vouches for T1, T2 and distinctness), the keys are appended, and the ghosts trimmed
        once. Trimming drops the oldest ghost of the longer list, which depends only on the
        ghost lists, so once at the end drops the ghosts that trimming after each key would."""
        self._batch = 0  # the store this batch was for has completed
        t1, t2, b1, b2, pending = self._t1, self._t2, self._b1, self._b2, self._pending
        all_new = (
            len(keys) > 1
            and b1.keys().isdisjoint(keys)
            and b2.keys().isdisjoint(keys)
            and (not pending or pending.keys().isdisjoint(keys))
            and (not self._cold or self._cold.keys().isdisjoint(keys))
            and (
                new
                or (
                    t1.keys().isdisjoint(keys)
                    and t2.keys().isdisjoint(keys)
                    and len(set(keys)) == len(keys)
                )
            )
        )
        if all_new:
            for key in keys:
                t1[key] = None
            self._trim_ghosts()
            return
        for key in keys:
            self.insert(key)

    def insert_cold(self, keys: Sequence[bytes]) -> None:
        """Absent `keys` on the cold list, evicted before any REPLACE, the first key first;
        they leave it for T1 (insert) or T2 (touch) once used."""
        t1, t2, cold = self._t1, self._t2, self._cold
        for key in keys:
            if key not in t1 and key not in t2 and key not in cold:
                cold[key] = None

    def touch(self, keys: Sequence[bytes]) -> None:
        """Move resident `keys` to T2's MRU end, tail first so the chain head ends up hottest."""
        t1, t2, cold = self._t1, self._t2, self._cold
        for key in reversed(keys):
            if key in t2:
                t2.move_to_end(key)
            elif key in t1:
                del t1[key]
                t2[key] = None
            elif cold and key in cold:
                del cold[key]
                t2[key] = None

    def remove(self, key: bytes) -> None:
        """Forget a resident (or pending) key; ghost entries are history and stay."""
        self._t1.pop(key, None)
        self._t2.pop(key, None)
        self._pending.pop(key, None)
        self._cold.pop(key, None)

    def evict(self, n: int, protected: Container[bytes] = frozenset()) -> list[bytes] | None:
        """Apply REPLACE n times, moving victims to the MRU end of B1 or B2; None if impossible."""
        self._check_count(n)
        cold: list[bytes] = []
        if self._cold and n:
            keep = protected.__contains__ if protected else None
            it = iter(self._cold) if keep is None else filterfalse(keep, self._cold)
            cold = list(islice(it, n))
        plan = self._plan_runs(n - len(cold), protected)
        if plan is None:
            return None
        for key in cold:  # copies: they leave no ghost
            del self._cold[key]
        if cold and len(cold) == n:
            return cold
        self._batch = 0  # this was the eviction the batch described
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        victims: list[bytes] = []
        # Each victim leaves its list for its ghost list's MRU end, in eviction order, as one
        # REPLACE per victim would.
        for run, from_t1 in plan:
            src, ghosts = (t1, b1) if from_t1 else (t2, b2)
            for key in run:
                del src[key]
                ghosts[key] = None
            victims += run
        victims = cold + victims
        # Residents became ghosts: the directory's size is unchanged, and over 2c only if
        # more than c keys were resident (a caller past capacity).
        if len(t1) + len(t2) + len(b1) + len(b2) > 2 * self.capacity:
            self._trim_ghosts()
        return victims

    def clear(self) -> None:
        """Forget every key, all ghosts, pending hits and the learned p."""
        for od in (self._t1, self._t2, self._b1, self._b2, self._pending, self._cold):
            od.clear()
        self._p = 0.0
        self._batch = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._cold)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2 or key in self._cold

    def keys_in_eviction_order(self) -> Iterator[bytes]:
        """Resident keys in the order successive REPLACE steps would evict them."""
        plan = self._plan_runs(len(self._t1) + len(self._t2), frozenset())
        assert plan is not None, "evicting every resident key cannot fail"
        return iter([*self._cold, *(k for run, _ in plan for k in run)])

    def _plan_runs(self, n: int, protected: Container[bytes]) -> _Plan | None:
        """The victims of n REPLACE steps as runs of one list each, without mutating anything
        (so evict can stay atomic); None when fewer than n keys are unprotected."""
        if n > len(self._t1) + len(self._t2):
            return None
        k = self._batch
        if n > k:  # no batch (or not this eviction's): n REPLACEs, nothing arriving between
            # T1 while |T1| > p, i.e. its first |T1| - floor(p) steps, then T2.
            t1_turns = max(0, len(self._t1) - math.floor(self._p))
            return self._three_runs(n, True, t1_turns, protected)
        # A batch: each step's key lands in T1 after it, so a REPLACE from T1 leaves |T1| as
        # it was and one from T2 grows it: T2 until |T1| counting the arrivals exceeds p.
        t1_ahead = len(self._t1) + k - n
        t2_turns = max(0, math.floor(self._p) - t1_ahead + 1)
        return self._three_runs(n, False, t2_turns, protected)

    def _three_runs(
        self, n: int, first_is_t1: bool, turns: int, protected: Container[bytes]
    ) -> _Plan | None:
        """`turns` steps prefer one list (`first`), the rest the other; a list with no
        unprotected key left hands its steps to the other one, so the victims are some of
        `first`, then some of the other, then (only if that ran dry) more of `first`."""
        first_od, other_od = (self._t1, self._t2) if first_is_t1 else (self._t2, self._t1)
        # Unfiltered first: the caller's own keys are rarely among the coldest, and a set
        # tells that in C; filter key by key only when one is.
        a = list(islice(first_od, min(n, turns)))
        b = list(islice(other_od, n - len(a)))
        if len(a) + len(b) == n and self._disjoint(protected, a, b):
            return [(a, first_is_t1), (b, not first_is_t1), ([], first_is_t1)]
        first: Iterator[bytes] = iter(first_od)
        other: Iterator[bytes] = iter(other_od)
        if protected:  # an empty set protects nothing: skip the per-key test
            first = filterfalse(protected.__contains__, first)
            other = filterfalse(protected.__contains__, other)
        a = list(islice(first, min(n, turns)))
        left = n - len(a)
        b = list(islice(other, left)) if left else []
        left -= len(b)
        c = list(islice(first, left)) if left else []
        if left != len(c):
            return None
        return [(a, first_is_t1), (b, not first_is_t1), (c, first_is_t1)]

    def _trim_ghosts(self) -> None:
        """Drop the oldest ghost of the longer list (B2's on a tie) until
        |T1|+|T2|+|B1|+|B2| <= 2c, with the drops from each list counted up front: all from
        the longer list while it stays longer, else the two end level (B1 keeping an odd one)."""
        b1, b2 = self._b1, self._b2
        g1, g2 = len(b1), len(b2)
        drop = min(len(self._t1) + len(self._t2) + g1 + g2 - 2 * self.capacity, g1 + g2)
        if drop <= 0:
            return
        if g1 - g2 >= drop:
            from_b1 = drop
        elif g2 - g1 >= drop:
            from_b1 = 0
        else:
            left = g1 + g2 - drop
            from_b1 = g1 - (left - left // 2)
        for _ in range(from_b1):
            b1.popitem(last=False)
        for _ in range(drop - from_b1):
            b2.popitem(last=False)
