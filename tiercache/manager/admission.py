"""Admission on reuse: the ghost map of sightings the manager's admitting tiers consult.

A tier with `admit_on_reuse` takes a block (demotion, write-around, write-through) only once
it has been sighted twice: stored or loaded. `Sightings` remembers how often each key was
sighted, for as many keys as the largest admitting tier holds, oldest forgotten first; it
holds keys only, no tier state. `admit_flags` checks the per-tier flags once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence


def admit_flags(admit_on_reuse: Sequence[bool], tiers: int) -> list[bool]:
    """The per-tier flags (default: none admits on reuse); ValueError unless there is one
    per tier and the first tier's is False (it admits every store)."""
    admit = list(admit_on_reuse) or [False] * tiers
    if len(admit) != tiers or admit[0]:
        raise ValueError("admit_on_reuse: one flag per tier, and the first tier admits every store")
    return admit


class Sightings:
    """key -> sightings (stores and loads), oldest first, at most `capacity` keys."""

    __slots__ = ("_max", "_seen")

    def __init__(self, capacity: int) -> None:
        self._seen: dict[bytes, int] = {}
        self._max = capacity

    def __len__(self) -> int:
        return len(self._seen)

    def count(self, key: bytes) -> int:
        """How often `key` was sighted (0: never, or forgotten)."""
        return self._seen.get(key, 0)

    def sight(self, keys: Iterable[bytes]) -> dict[bytes, int]:
        """Count one sighting of each key, the oldest keys forgotten; returns the counts as
        they were (for `unsight`)."""
        seen = self._seen
        before: dict[bytes, int] = {}
        for k in keys:
            before[k] = n = seen.pop(k, 0)
            seen[k] = n + 1
        over = len(seen) - self._max
        if over > 0:
            for k in list(itertools.islice(seen, over)):
                del seen[k]
        return before

    def unsight(self, before: dict[bytes, int]) -> None:
        """Undo a `sight` (its keys go back to their counts, or are forgotten)."""
        seen = self._seen
        for k, n in before.items():
            if n:
                seen[k] = n
            else:
                seen.pop(k, None)

    def reused(self, keys: Sequence[bytes]) -> list[bytes]:
        """Those of `keys` sighted at least twice, in order."""
        seen = self._seen
        return [k for k in keys if seen.get(k, 0) >= 2]
