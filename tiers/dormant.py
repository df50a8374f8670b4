"""`DormantIndex`: the blocks a persistent tier recovered at open that the manager has not
taken over yet, in fixed-width arrays (17 bytes per block, no Python object per block).

A store of millions of blocks cannot afford the manager's per-key entries for every block
at open. The manager wakes a dormant block (takes it over, as if adopted at open) when a
lookup or a store reaches its key, and wakes the oldest when it needs their slots. Until
then a dormant block is held, counted as used, and less recently used than anything the
manager knows: evicting dormant blocks first, oldest first, is LRU over the recovered order.

Primitives: `find(keys)` (slots of the dormant ones, -1 for the rest; changes nothing),
`wake(slots)`, `wake_oldest(n)`, `open_keys()` (every key recovered at open, oldest first),
`n` (how many are still dormant).

Keys are looked up by their first 8 bytes in a sorted array, then compared in full against
the tier's own key column (which this index reads but never writes).
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left
from collections.abc import Sequence

import numpy as np

from tiercache.hashing import KEY_SIZE

_SCALAR_MAX = 6  # batches up to this many keys are searched key by key (no numpy calls)


class DormantIndex:
    """Recovered blocks the manager has not taken over (see the module docstring).

    The sorted first words, their slots and the per-slot dormant flags are `array`s and
    `bytearray`s with numpy views on the same memory: a short batch (the common lookup) is
    searched with `bisect` on them, a long one with numpy."""

    def __init__(self, keycol: np.ndarray, slots: np.ndarray) -> None:
        """`keycol`: the tier's key per slot (`V16`, read only here; a slot's entry must not
        change while it is dormant); `slots`: the recovered blocks' slots, oldest first."""
        wide = len(keycol) >= 1 << 32
        self._keycol = keycol
        self._pairs = keycol.view(np.uint64).reshape(-1, 2)  # the key as two words, per slot
        self._keybytes = memoryview(keycol.view(np.uint8))  # the same, as 16 bytes per slot
        self._order = slots.astype(np.int64 if wide else np.uint32)
        self._flags = bytearray(len(keycol))  # 1: the slot's block is dormant
        self._asleep = np.frombuffer(self._flags, dtype=bool)
        self._asleep[self._order] = True
        hi = self._pairs[self._order, 0]
        perm = np.argsort(hi, kind="stable")
        self._hi_a = array("Q", hi[perm].tobytes())  # sorted first words
        self._by_a = array("q" if wide else "I", self._order[perm].tobytes())  # their slots
        del hi, perm
        self._hi = np.frombuffer(self._hi_a, dtype=np.uint64)
        self._by_hi = np.frombuffer(self._by_a, dtype=self._order.dtype)
        self._cursor = 0  # wake_oldest resumes here in _order
        self.n = len(self._order)

    def find(self, keys: Sequence[bytes]) -> list[int]:
        """Per key, the slot holding it dormant, or -1. Changes nothing."""
        if not self.n or not keys or any(len(k) != KEY_SIZE for k in keys):
            return [-1] * len(keys)  # a key of another width is never one of a tier's
        if len(keys) <= _SCALAR_MAX:
            return [self._find_one(k) for k in keys]
        out = [-1] * len(keys)
        q = np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(-1, 2)
        hi, top = self._hi, len(self._hi)
        pos = np.searchsorted(hi, q[:, 0])
        at = np.minimum(pos, top - 1)
        cand = self._by_hi[at]
        first = hi[at] == q[:, 0]
        ok = first & (self._pairs[cand, 1] == q[:, 1]) & self._asleep[cand]
        for i in np.flatnonzero(ok).tolist():
            out[i] = int(cand[i])
        # Two keys sharing their first word (rare): look past the first candidate.
        for i in np.flatnonzero(first & ~ok).tolist():
            out[i] = self._find_one(keys[i])
        return out

    def _find_one(self, key: bytes) -> int:
        """`find` of one 16-byte key, in plain Python on the arrays."""
        q = int.from_bytes(key[:8], sys.byteorder)
        hi, by, flags, kb = self._hi_a, self._by_a, self._flags, self._keybytes
        p = bisect_left(hi, q)
        while p < len(hi) and hi[p] == q:
            s = by[p]
            if flags[s] and kb[s * KEY_SIZE : (s + 1) * KEY_SIZE] == key:
                return s
            p += 1
        return -1

    def wake(self, slots: Sequence[int]) -> None:
        """The manager took over these dormant slots (distinct, each found by `find`)."""
        flags = self._flags
        if any(not flags[s] for s in slots):
            raise ValueError("wake: a slot is not dormant")
        for s in slots:
            flags[s] = 0
        self.n -= len(slots)

    def wake_oldest(self, n: int) -> tuple[list[bytes], list[int]]:
        """Take over up to `n` of the oldest dormant blocks: their keys and slots, oldest
        first."""
        slots: list[int] = []
        order = self._order
        while len(slots) < n and self._cursor < len(order):
            need = n - len(slots)
            chunk = order[self._cursor : self._cursor + max(1024, 2 * need)]
            idx = np.flatnonzero(self._asleep[chunk])[:need]
            self._cursor += int(idx[-1]) + 1 if len(idx) == need else len(chunk)
            got = chunk[idx]
            self._asleep[got] = False
            slots.extend(got.tolist())
        self.n -= len(slots)
        return self._keycol[slots].tolist(), slots

    def open_keys(self) -> list[bytes]:
        """Every key recovered at open, oldest first (valid while none of their slots has
        been written again)."""
        return self._keycol[self._order].tolist()
