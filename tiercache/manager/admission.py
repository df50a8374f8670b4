"""Admission on reuse: the ghost map of sightings the manager's admitting tiers consult.

A tier with `admit_on_reuse` takes a block (demotion, write-around, write-through) only once
it has been sighted twice: stored or loaded. `Sightings` remembers how often each key was
sighted, for as many keys as the largest admitting tier holds, oldest forgotten first; it
holds keys only, no tier state. `admit_flags` checks the per-tier flags once. `Admission`
answers which keys a tier takes: all, none (a read-only tier), or those sighted twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from tiercache.manager.levels import Level


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


class Admission:
    """Which blocks each tier takes (see the module doc). `mask`: the tiers admitting on reuse;
    `gated`: those and the read-only ones (a demotion asks them); `seen`: the sightings, of as
    many keys as the largest admitting tier holds."""

    __slots__ = ("gated", "mask", "seen")

    def __init__(self, levels: Sequence[Level], admit_on_reuse: Sequence[bool]) -> None:
        admit = admit_flags(admit_on_reuse, len(levels))
        self.mask = sum(lv.bit for lv in levels if admit[lv.index])
        self.gated = self.mask | sum(lv.bit for lv in levels if lv.tier.read_only)
        self.seen = Sightings(
            max((lv.tier.capacity_blocks for lv in levels if admit[lv.index]), default=0)
        )

    def admitted(self, level: Level, keys: Sequence[bytes]) -> list[bytes]:
        """The keys `level` takes: all, none (read-only), or with admission on reuse those
        sighted twice (the rest are counted as not admitted)."""
        if level.tier.read_only:
            return []
        if not level.bit & self.mask:
            return list(keys)
        out = self.seen.reused(keys)
        level.counters.not_admitted += len(keys) - len(out)
        return out
