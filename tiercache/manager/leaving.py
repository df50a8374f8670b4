"""Leaving blocks: blocks a move is taking out of a tier, still readable from their source slot.

A demotion releases its victim's slot in the same plan that reuses it (the plan's store, or
a deeper move's copy, writes the next block there; `Tier.release`: the block stays stored
until `ReleasedSources` has it settled, once the move ends). While the move runs, the victim's bytes
are still whole in that slot, so a read may be served from it, under three rules:
- a read pins the source slot (`tiercache.levels.Loads`, `reads`);
- whoever writes the slot's next block waits until the slot is *busy* no more: neither the
  source of a move still running (a new read could start) nor pinned by a read;
- a move that completes or is given up (`unmove`) ends the block's leaving: it is then
  served from where it arrived, or is a miss (dropped, as any failed move's block).

`LeavingBlocks` is the record of them: key -> (source tier, source slot), and the reverse,
source -> key, for `busy`. It holds no bytes and no tier; the manager changes it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager


class LeavingBlocks(dict[bytes, tuple[int, int]]):
    """key -> (tier, slot) of each leaving block; `sources`: (tier, slot) -> key;
    `planning`: whether the plan being made demotes leaving blocks (`plan`)."""

    __slots__ = ("planning", "sources")

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[tuple[int, int], bytes] = {}
        self.planning = False

    @contextmanager
    def plan(self, leaving: bool) -> Iterator[None]:
        """While a plan is made: its demotions make leaving blocks if `leaving`."""
        self.planning = leaving
        try:
            yield
        finally:
            self.planning = False

    def leave(self, tier: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """`keys` leave `tier` from `slots` (their moves are planned)."""
        sources = self.sources
        for k, s in zip(keys, slots, strict=True):
            where = (tier, s)
            self[k] = where
            sources[where] = k

    def end(self, keys: Iterable[bytes]) -> None:
        """The moves of `keys` completed or were given up: no new read is served from their
        sources (reads in flight keep their pins). Keys not leaving are ignored."""
        sources = self.sources
        for k in keys:
            where = self.pop(k, None)
            if where is not None and sources.get(where) == k:
                del sources[where]

    def busy(self, tier: int, slots: Iterable[int]) -> bool:
        """Whether one of `slots` of `tier` is still the source of a leaving block."""
        sources = self.sources
        return bool(sources) and any((tier, s) in sources for s in slots)


class ReleasedSources(dict[bytes, tuple[int, int]]):
    """key -> (tier, slot) of each demoted block whose source slot was released
    (`Tier.release`: reusable, the block still stored there) and whose move has not ended.
    Every planned demotion is recorded, leaving block or not; `take` hands the manager what
    to `Tier.settle` once the moves end, either way. Holds no bytes and no tier."""

    __slots__ = ()

    def record(
        self, tier: int, keys: Sequence[bytes], slots: Sequence[int], dropped: Collection[bytes]
    ) -> dict[int, None]:
        """Record the demoted `keys` (from `slots` of `tier`) but those `dropped` (no tier
        took them); their slots, in order (an ordered set)."""
        moved: dict[int, None] = {}
        for k, s in zip(keys, slots, strict=True):
            if k not in dropped:
                self[k] = (tier, s)
                moved[s] = None
        return moved

    def take(self, keys: Iterable[bytes]) -> dict[int, tuple[list[int], list[bytes]]]:
        """The released sources of `keys` (others ignored), removed: tier -> (slots, keys)."""
        out: dict[int, tuple[list[int], list[bytes]]] = {}
        for k in keys:
            where = self.pop(k, None)
            if where is not None:
                slots, ks = out.setdefault(where[0], ([], []))
                slots.append(where[1])
                ks.append(k)
        return out
