"""The manager's per-tier state: `Level` (a tier with its policy, key index, pins and
`TierCounters`), the outstanding loads (`Loads`) and the pin-count helpers they use.

`OffloadingManager` owns the levels; it and its `Adoption` are the only ones that change them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass

from tiercache.policies import EvictionPolicy
from tiercache.records import BlockMove, OffloadingEvent, StoreSpec
from tiercache.tiers import Tier


@dataclass
class TierCounters:
    """Per-tier counters; `hits`/`misses` count blocks asked for by `lookup`."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    loaded: int = 0
    evictions: int = 0
    demoted_in: int = 0
    dropped: int = 0
    errors: int = 0
    discovered: int = 0  # blocks another process stored in this shared tier, found by lookup
    written_through: int = 0  # blocks copied here by write-through, completed
    through_dropped: int = 0  # write-through copies given up (queue full, no room, failed)
    not_admitted: int = 0  # blocks kept out: admission on reuse, sighted only once
    suspensions: int = 0  # times the circuit breaker opened this tier (a missed deadline)


@dataclass(frozen=True, slots=True)
class Index:
    """The manager's index, given to its collaborators (`Adoption`, `Placement`, `Copies`),
    which change its contents in place: the levels (fastest first), key -> bitmask of the
    tiers where it is ready, resp. held (with one tier, `present` is that tier's slot map),
    the keys moving between tiers, and the event queue."""

    levels: list[Level]
    ready: dict[bytes, int]
    present: dict[bytes, int]
    moving: set[bytes]
    events: list[OffloadingEvent]


class Level:
    """A tier with its policy, its key index and its counters.

    The index is plain dicts, no record per block (the manager's hot paths are dict
    operations, so fewer of them and no allocation per block is what makes it fast):
    `slots` maps every key this tier holds, ready or still being written, to its slot;
    `pins` maps the keys being loaded from this tier to their count of outstanding loads.
    Whether a held key is ready is the manager's `_ready` bitmask.
    """

    __slots__ = ("bit", "cold", "counters", "index", "medium", "pins", "policy", "slots", "tier")

    def __init__(self, index: int, tier: Tier, policy: EvictionPolicy) -> None:
        self.index = index
        self.bit = 1 << index
        self.tier = tier
        self.policy = policy
        self.medium = tier.medium
        self.slots: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}
        # Write-through copies of blocks a faster tier still holds: inserted cold (evicted
        # first), made as recent as a demotion when the block leaves the faster tiers.
        self.cold: set[bytes] = set()
        self.counters = TierCounters()

    def move_to(
        self, dst: Level, keys: Sequence[bytes], src_slots: Iterable[int], dst_slots: Sequence[int]
    ) -> BlockMove:
        """The move of `keys` from `src_slots` of this tier into `dst_slots` of `dst`."""
        return BlockMove(
            tuple(keys),
            StoreSpec(self.index, self.medium, tuple(src_slots)),
            StoreSpec(dst.index, dst.medium, tuple(dst_slots)),
        )

    def hold(self, present: dict[bytes, int], keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Record `keys` as held (not ready yet) in `slots` (multi-tier only: `present` is
        the manager's key -> bitmask of tiers holding it)."""
        slots_of, bit = self.slots, self.bit
        for k, s in zip(keys, slots, strict=True):
            slots_of[k] = s
            present[k] = present.get(k, 0) | bit

    def evictable(self, ready: Mapping[bytes, int], protect: Collection[bytes], need: int) -> int:
        """How many of the ready blocks the policy may evict (not pinned, not in `protect`),
        or any number >= `need` when that is plain without counting. `ready`: the manager's
        key -> bitmask of tiers where it is ready."""
        pins = self.pins
        resident = len(self.policy) + self.tier.dormant_blocks
        if resident - len(pins) - len(protect) >= need:  # `protect` may hold absent keys
            return resident
        bit = self.bit
        kept = sum(1 for k in protect if ready.get(k, 0) & bit and k not in pins)
        return resident - len(pins) - kept

    def protected(self, keys: Collection[bytes]) -> Container[bytes]:
        """What the policy may not evict: `keys`, and the pinned blocks, as one set (its
        membership test runs in C; loads are short, so few keys are pinned at once)."""
        if not self.pins:
            return keys if isinstance(keys, set | frozenset) else set(keys)
        return self.pins.keys() | keys

    def warm(self, ready: Mapping[bytes, int], keys: list[bytes]) -> list[bytes]:
        """`keys` left a faster tier: those this level holds as cold write-through copies
        become as recent as a demotion would have made them (they were kept only while room
        allowed; now each is the block's only copy). Returns the other keys."""
        if not keys or not self.cold:
            return keys
        here = [k for k in keys if k in self.cold and ready.get(k, 0) & self.bit]
        if not here:
            return keys
        policy = self.policy
        for k in here:
            policy.remove(k)
        policy.insert_many(here[::-1])  # the chain's head ends most recent
        self.cold.difference_update(here)
        done = set(here)
        return [k for k in keys if k not in done]

    def stats(self, *, through_queued: int, suspended_s: float) -> dict[str, int]:
        """Capacity, usage and counters of this tier (`OffloadingManager.stats`' row);
        `through_queued`: its write-through backlog, `suspended_s`: its breaker's time left."""
        c, tier = self.counters, self.tier
        return {
            "capacity_blocks": tier.capacity_blocks,
            "used_blocks": tier.used_blocks,
            "ready_blocks": len(self.policy) + tier.dormant_blocks,
            "dormant_blocks": tier.dormant_blocks,
            "pinned_blocks": len(self.pins),
            **vars(c),  # every `TierCounters` field
            "through_queued": through_queued,
            "suspended_ms": int(suspended_s * 1000),
        }


def check_loads(
    keys: Sequence[bytes], pins: Container[bytes], loads: Callable[[bytes], int]
) -> None:
    """Raise KeyError, before anything is unpinned, unless every key has an outstanding load
    for each time it is given; `pins` holds the keys with any, `loads(key)` counts them."""
    if len(set(keys)) == len(keys):  # distinct keys: one outstanding load each suffices
        for k in keys:
            if k not in pins:
                raise no_load(k)
        return
    need: dict[bytes, int] = {}
    for k in keys:
        need[k] = need.get(k, 0) + 1
        if loads(k) < need[k]:
            raise no_load(k)


def no_load(key: object) -> KeyError:
    shown = key.hex() if isinstance(key, bytes) else repr(key)
    return KeyError(f"complete_load: block {shown} has no outstanding load")


def not_ready(key: object) -> KeyError:
    shown = key.hex() if isinstance(key, bytes) else repr(key)
    return KeyError(f"prepare_load: block {shown} is not ready in any tier")


def unpin(pins: dict[bytes, int], key: bytes) -> None:
    """Drop one outstanding load of `key` (a key leaves the map when its last load ends)."""
    n = pins[key] - 1
    if n:
        pins[key] = n
    else:
        del pins[key]


def count_lookup(
    levels: Sequence[Level],
    ready: Mapping[bytes, int],
    keys: Sequence[bytes],
    n: int,
    missed: int,
    off: int = 0,
    leaving: Mapping[bytes, tuple[int, int]] | None = None,
) -> None:
    """Count a lookup of `keys` whose first `n` are served (by the fastest tier not in the
    breaker mask `off` holding each; a leaving block by its source tier) and `missed` not:
    a hit where a block is served, a miss in every faster tier and for every missed block."""
    per_tier = [0] * len(levels)
    for k in keys[:n]:
        m = ready[k] if leaving is None or k in ready else 1 << leaving[k][0]
        m &= ~off
        per_tier[(m & -m).bit_length() - 1] += 1
    served_below = n
    for lv, hits in zip(levels, per_tier, strict=True):
        served_below -= hits
        lv.counters.hits += hits
        lv.counters.misses += missed + served_below


class Loads:
    """The outstanding loads of a manager over its levels, and the slots they pin.

    One tier: its level's `pins` are the whole story (`release_single`). Several: `of` maps a
    key to where each of its loads reads, a tier index (the key is pinned in that level's
    `pins`) or, for a leaving block, its source (tier, slot), pinned in `reads` ((tier, slot)
    -> reads in flight). A slot freed while a read pins it goes back to its tier when the
    last read ends (`free_later`).
    """

    __slots__ = ("free_later", "levels", "of", "reads")

    def __init__(self, levels: Sequence[Level]) -> None:
        self.levels = levels
        self.of: dict[bytes, list[int | tuple[int, int]]] = {}
        self.reads: dict[tuple[int, int], int] = {}
        self.free_later: set[tuple[int, int]] = set()

    def pin(
        self,
        keys: Sequence[bytes],
        tier_of: Sequence[int],
        leaving: Mapping[bytes, tuple[int, int]],
        ready: Mapping[bytes, int],
    ) -> list[int]:
        """Pin each key in tier `tier_of[i]`, or a leaving block (in `leaving`, ready
        nowhere) at its source slot; returns the slots read."""
        levels, pins, reads = self.levels, self.of, self.reads
        slots: list[int] = []
        for k, t in zip(keys, tier_of, strict=True):
            lv = levels[t]
            pin: int | tuple[int, int] = t
            if k in leaving and not ready.get(k, 0):  # leaving: its source slot is pinned
                pin = leaving[k]
                reads[pin] = reads.get(pin, 0) + 1
                slots.append(pin[1])
            else:
                lv.pins[k] = lv.pins.get(k, 0) + 1
                slots.append(lv.slots[k])
            p = pins.get(k)
            if p is None:
                pins[k] = [pin]
            else:
                p.append(pin)
        return slots

    def pin_single(self, keys: Sequence[bytes]) -> tuple[int, ...]:
        """`pin` with one tier (every key ready there); returns the slots read."""
        lv = self.levels[0]
        pins = lv.pins
        get = pins.get
        for k in keys:
            pins[k] = get(k, 0) + 1
        return tuple(map(lv.slots.__getitem__, keys))

    def release(self, keys: Sequence[bytes]) -> None:
        """End one load of each key, oldest first. KeyError (and nothing unpinned) if a key
        has no outstanding load."""
        pins = self.of
        check_loads(keys, pins, lambda k: len(pins.get(k, ())))  # key -> tier of each load
        levels = self.levels
        for k in keys:
            p = pins[k]
            t = p.pop(0)
            if not p:
                del pins[k]
            if isinstance(t, tuple):
                self._end_read(t)
            else:
                unpin(levels[t].pins, k)

    def release_single(self, keys: Sequence[bytes]) -> None:
        """`release` with one tier: check every key has enough pins, then unpin."""
        pins = self.levels[0].pins
        check_loads(keys, pins, lambda k: pins.get(k, 0))  # key -> count of loads
        for k in keys:
            unpin(pins, k)

    def _end_read(self, where: tuple[int, int]) -> None:
        """A read of a leaving block's source slot ended; the last one returns the slot to
        its tier if it was freed meanwhile."""
        n = self.reads[where] - 1
        if n:
            self.reads[where] = n
            return
        del self.reads[where]
        if where in self.free_later:
            self.free_later.discard(where)
            self.levels[where[0]].tier.free((where[1],))

    def free(self, level: Level, slot: int) -> None:
        """Return a slot to its tier, once no read of a leaving block pins it."""
        if self.reads and (level.index, slot) in self.reads:
            self.free_later.add((level.index, slot))
        else:
            level.tier.free((slot,))

    def reading(self, tier: int, slots: Iterable[int]) -> bool:
        """Whether a read of a leaving block pins one of `slots` of `tier`."""
        reads = self.reads
        return bool(reads) and any((tier, s) in reads for s in slots)
