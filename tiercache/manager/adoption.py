"""`Adoption`: taking over blocks a tier holds that the manager does not index yet.

Two kinds, one way in (`adopt`: slot maps, ready masks, the policy, the stored event):
- dormant blocks: what a persistent tier recovered at open without handing it over
  (`Tier.open_columns`, tiers/dormant.py). No per-key state is kept for them until a lookup or
  a store reaches a key (`wake_run`, `wake_keys`, `wake_one`), or until their tier needs room
  (`wake_oldest`: dormant blocks are the least recently used, so its policy's first victims).
  A key is then woken in every tier holding it dormant: one the manager indexes is dormant
  nowhere. Their stored event keeps its place in the event queue; its keys are listed when
  events are taken or before a slot of the tier is freed (`send_open`: a write into the slot
  would change the key the tier reads there).
- discovered blocks: what another process stored in a shared tier after it opened, found by a
  probe when a lookup misses (`probe`, `take`; `take_one`: the common one-key first lookup on
  the only tier, in one call).

`holds_dormant` sees dormant blocks without waking them; `first_tiers` (and `wake_one`) wake
the blocks asked about, whose caller is about to use them.

Input, given once at construction: the manager's `Index`. This class changes the index only by
adding keys to it; the manager owns every other change.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from tiercache.manager.levels import Index, Level
from tiercache.records import OffloadingEvent


class Adoption:
    """Dormant waking and shared discovery over a manager's levels (see the module doc)."""

    __slots__ = (
        "events",
        "levels",
        "moving",
        "open_marks",
        "present",
        "ready",
        "shared",
        "single",
        "sleepers",
    )

    def __init__(self, index: Index) -> None:
        """Adopt what each tier recovered at open (`Tier.open_columns`); a tier left holding
        dormant blocks gets its open event's place in the event queue."""
        self.levels = levels = index.levels
        self.single = len(levels) == 1  # then `present` is the only level's slot map
        self.ready, self.present, self.moving = index.ready, index.present, index.moving
        self.events = events = index.events
        # Tiers other processes write into: a lookup miss asks them (`probe`).
        self.shared = [lv for lv in levels if lv.tier.shared]
        for level in levels:
            self.adopt(level, *level.tier.open_columns())
        self.sleepers = [lv for lv in levels if lv.tier.dormant_blocks]
        self.open_marks: dict[int, int] = {}  # tier -> its open event's place in `events`
        for level in self.sleepers:
            self.open_marks[level.index] = len(events)
            events.append(OffloadingEvent((), level.medium, False))

    def adopt(
        self,
        level: Level,
        keys: Sequence[bytes],
        slots: Sequence[int],
        *,
        event: bool = True,
        cold: bool = False,
    ) -> None:
        """Index `keys` (oldest first) as held and ready in `slots` of `level` and hand them to
        its policy (`cold`: as its first victims). `event`: emit their stored event (a woken
        block's was at open). Bulk dict updates: at open this runs once per held block."""
        if not keys:
            return
        ready, present, single = self.ready, self.present, self.single
        bit, slots_of = level.bit, level.slots
        if single and len(keys) == 1 and keys[0] not in slots_of:
            # One key new to the only tier (a single-key first lookup): no bulk updates.
            slots_of[keys[0]] = slots[0]
            ready[keys[0]] = bit
            new = True
        else:
            held = len(slots_of)
            slots_of.update(zip(keys, slots, strict=True))  # with one tier, `present` too
            # Every key new to this tier (and so to its policy) and none given twice: the
            # policy may skip its residency tests (and, with one tier, no key has a ready bit).
            new = len(slots_of) - held == len(keys)
            for masks in (ready,) if single else (ready, present):
                if not masks or (new and single):
                    masks.update(dict.fromkeys(keys, bit))
                    continue
                for k in keys:
                    masks[k] = masks.get(k, 0) | bit
        if cold:
            level.policy.insert_cold(keys)
        else:
            level.policy.insert_many(keys, new=new)
        if event:
            self.events.append(OffloadingEvent(tuple(keys), level.medium, False))

    # -- shared discovery ------------------------------------------------------------------
    def take_one(self, level: Level, keys: Sequence[bytes], count: bool) -> int:
        """A first lookup of one key (`keys`, of length 1) that no tier indexes, `level`'s
        tier the only one, shared, with a free slot: probe the store and, if it holds the key,
        adopt it (1) or not (0), counted as a hit or a miss unless `count` is False. What
        `probe`, `take` and the lookup's counting do for it, in one call: the common first
        lookup after a lazy open."""
        tier, c = level.tier, level.counters
        if not tier.probe(keys) or not (slots := tier.adopt(keys)):
            if count:
                c.misses += 1
            return 0
        k = keys[0]
        level.slots[k] = slots[0]  # with one tier, `present` too
        self.ready[k] = level.bit
        level.policy.insert_many(keys, new=True)
        self.events.append(OffloadingEvent((k,), level.medium, False))
        c.discovered += 1
        if count:
            c.hits += 1
        return 1

    def probe(
        self, keys: Sequence[bytes], n: int, off: int = 0
    ) -> Iterator[tuple[Level, Sequence[bytes], int]]:
        """A lookup missed at keys[n]: ask the shared tiers, fastest first (none in the breaker
        mask `off`), for the leading keys from there that another process stored after they
        opened. Yields (level, those keys up to the first one held here, how many of them it
        holds) for each tier that holds some, lazily: the caller stops once one is `take`n."""
        present = self.present
        tail = keys[n:] if n else keys
        for i, k in enumerate(tail):
            if k in present:  # held here already, its store or move still in flight
                tail = tail[:i]
                break
        for lv in self.shared if tail else ():
            if off & lv.bit:
                continue
            found = lv.tier.probe(tail)
            if found:
                yield lv, tail, found

    def take(self, level: Level, tail: Sequence[bytes], found: int) -> int:
        """Adopt the leading keys of `tail` that a `probe` of `level` found (`found` of them),
        as many as its free slots take; returns how many."""
        free = level.tier.free_blocks
        take = tail if found == len(tail) <= free else tail[: min(found, free)]
        if not take:
            return 0
        slots, n = level.tier.adopt(take), len(take)
        if not slots:
            return 0
        # Tail first into the policy, so the chain's head ends up most recently used.
        self.adopt(level, take[::-1], slots[::-1]) if n > 1 else self.adopt(level, take, slots)
        level.counters.discovered += n
        return n

    # -- dormant blocks --------------------------------------------------------------------
    def holds_dormant(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (none indexed) some tier holds dormant; nothing is woken."""
        found = [False] * len(keys)
        for lv in self.sleepers:
            found = [f or s >= 0 for f, s in zip(found, lv.tier.find_dormant(keys), strict=True)]
        return sum(found)

    def wake_one(self, key: bytes) -> int:
        """The ready mask of `key` (not ready in any tier), after waking it where some tier
        holds it dormant and nothing is in flight for it here."""
        if not self.sleepers or key in self.present or key in self.moving:
            return 0
        return self.ready.get(key, 0) if self.wake_keys((key,)) else 0

    def first_tiers(
        self, keys: Sequence[bytes], leaving: Mapping[bytes, tuple[int, int]], stop: bool
    ) -> list[int]:
        """The fastest tier where each of `keys` is ready (a level's bit is `1 << index`), or
        -1 where none holds it: a leaving block (in `leaving`) where its source is, a dormant
        one after waking it. `stop`: only up to the first key held nowhere (the list is then
        shorter, and no dormant block past it is woken). One pass over a hit's keys, which
        head shards make many."""
        out = []
        get = self.ready.get
        for k in keys:
            mask = get(k, 0)
            if not mask and k in leaving:
                out.append(leaving[k][0])
                continue
            mask = mask or self.wake_one(k)
            if not mask and stop:
                break
            out.append((mask & -mask).bit_length() - 1 if mask else -1)
        return out

    def wake_run(self, keys: Sequence[bytes], n: int) -> int:
        """A lookup stopped at keys[n]: take over the leading run of the keys from there that
        no tier indexes here but some tier holds dormant, in every tier holding each (the
        chain's head ends up most recently used). Returns the run's length."""
        present, moving = self.present, self.moving
        tail: list[bytes] = []
        for k in keys[n:]:
            if k in present or k in moving:
                break
            tail.append(k)
        if not tail:
            return 0
        if len(self.sleepers) == 1:  # one persistent tier: the same run, no per-tier lists
            lv = self.sleepers[0]
            slots = lv.tier.find_dormant(tail)
            run = 0
            while run < len(tail) and slots[run] >= 0:
                run += 1
            return self._wake(lv, tail[:run], slots[:run])
        found = [(lv, lv.tier.find_dormant(tail)) for lv in self.sleepers]
        run = 0
        while run < len(tail) and any(slots[run] >= 0 for _, slots in found):
            run += 1
        self._wake_found(tail[:run], found)
        return run

    def wake_keys(self, keys: Sequence[bytes], skip: Level | None = None) -> int:
        """Take over every one of `keys` (distinct, none indexed here) some tier other than
        `skip` holds dormant; returns how many copies were woken."""
        found = [(lv, lv.tier.find_dormant(keys)) for lv in self.sleepers if lv is not skip]
        return self._wake_found(keys, found)

    def _wake_found(self, keys: Sequence[bytes], found: list[tuple[Level, list[int]]]) -> int:
        """Wake, in each level, those of `keys` its `find_dormant` answer (slots, -1 for
        none; it may run past `keys`) gives a slot; returns how many copies were woken."""
        woken = 0
        for lv, slots in found:
            here = [i for i in range(len(keys)) if slots[i] >= 0]
            woken += self._wake(lv, [keys[i] for i in here], [slots[i] for i in here])
        return woken

    def _wake(self, level: Level, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        """Take over dormant blocks `keys` in `slots` of `level`, the first most recently
        used."""
        if not keys:
            return 0
        level.tier.wake(slots)
        self.adopt(level, list(keys[::-1]), list(slots[::-1]), event=False)
        if not level.tier.dormant_blocks:
            self.sleepers.remove(level)
        return len(keys)

    def wake_oldest(self, level: Level, n: int) -> None:
        """`level` must evict `n` blocks: its oldest dormant ones (least recently used) are
        taken over first, as its policy's first victims, and their copies dormant in other
        tiers with them (a key is held dormant nowhere once it is indexed here)."""
        if n <= 0 or not level.tier.dormant_blocks:
            return
        keys, slots = level.tier.wake_oldest(n)
        if not level.tier.dormant_blocks:
            self.sleepers.remove(level)
        self.adopt(level, keys, slots, event=False, cold=True)
        if self.sleepers:
            self.wake_keys(keys, skip=level)

    def send_open(self, level: Level) -> None:
        """List the keys of `level`'s open event (left dormant at open), in its place in the
        queue: when events are taken, or before a slot of the level is freed."""
        at = self.open_marks.pop(level.index, None)
        if at is not None:
            keys = tuple(level.tier.open_keys())
            self.events[at] = OffloadingEvent(keys, level.medium, False)
