"""`Placement`: where new blocks go, and the room made for them.

- `first_tier`: slots for a store (or a promotion) in the first tier;
- `around`: a store that does not fit the first tier: its head there, the rest into the next
  tiers with room (write-around);
- `room`, `make_room`: how many blocks a tier can take, and the slots, its policy's victims
  leaving;
- `evict`: victims leave a tier; those no lower tier holds are demoted into the first lower
  tier that admits them (`Admission`) and has room, past a suspended one (`CircuitBreaker`),
  as moves of the plan; their sources are released, not freed, until the moves end
  (`ReleasedSources`), and readable meanwhile where the plan makes leaving blocks
  (`LeavingBlocks`).

Inputs, given once at construction: the manager's `Index` and its collaborators.
It changes the index as a plan does; `OffloadingManager` decides when a plan is made.
"""

from __future__ import annotations

from collections.abc import Collection

from tiercache.manager.admission import Admission
from tiercache.manager.adoption import Adoption
from tiercache.manager.breaker import CircuitBreaker
from tiercache.manager.leaving import LeavingBlocks, ReleasedSources
from tiercache.manager.levels import Index, Level
from tiercache.records import BlockMove, OffloadingEvent, PrepareStoreOutput, StoreSpec, TierWrite


class Placement:
    """Slot reservation, eviction and demotion over a manager's levels (see the module doc)."""

    def __init__(
        self,
        index: Index,
        *,
        leaving: LeavingBlocks,
        released: ReleasedSources,
        breaker: CircuitBreaker,
        admission: Admission,
        adoption: Adoption,
    ) -> None:
        self.levels = index.levels
        self.single = len(self.levels) == 1  # then `present` is the only level's slot map
        self.ready, self.present = index.ready, index.present
        self.moving, self.events = index.moving, index.events
        self.leaving, self.released, self.breaker = leaving, released, breaker
        self.admission, self.adoption = admission, adoption

    def first_tier(self, new: list[bytes], protect: Collection[bytes]) -> PrepareStoreOutput | None:
        """Slots for `new` in the first tier, its policy's victims leaving (demoted by the
        plan's moves); None, changing nothing (the policy included), if it cannot make the
        room."""
        first = self.levels[0]
        tier = first.tier
        need = len(new) - tier.free_blocks
        # Refusals first, before the policy hears of the miss: a None changes nothing, ARC's
        # p and ghost lists included.
        if need > 0 and (
            len(new) > tier.capacity_blocks or first.evictable(self.ready, protect, need) < need
        ):
            return None
        if new:  # before evict: ARC adapts p for ghost hits first, as the paper orders it
            first.policy.on_miss(new)
        victims: list[bytes] = []
        if need > 0:
            self.adoption.wake_oldest(first, need)
            got = first.policy.evict(need, first.protected(protect))
            if got is None:  # a policy that refuses what it holds unprotected (see Level.evictable)
                return None
            victims = got
        # From here on nothing fails: every state change below is committed together.
        moves: list[BlockMove] = []
        if victims:
            self.evict(first, victims, moves)
        slots = tier.allocate(new)
        assert slots is not None, "first tier ran out of slots after eviction"
        if self.single:
            first.slots.update(zip(new, slots, strict=True))  # with one tier: `present` too
        else:
            first.hold(self.present, new, slots)
        return PrepareStoreOutput(
            keys_to_store=tuple(new),
            store_spec=StoreSpec(0, first.medium, tuple(slots)),
            evicted_keys=tuple(victims),
            moves=tuple(moves),
        )

    def around(
        self, new: list[bytes], protect: Collection[bytes], off: int = 0
    ) -> PrepareStoreOutput | None:
        """`new` does not fit the first tier: its head goes there as far as room can be made,
        the rest into the lower tiers in order, each making room through its policy. Tiers
        in the breaker mask `off` are skipped."""
        first = self.levels[0]
        room = 0 if off & first.bit else self.room(first, protect, len(new))
        head, rest = new[:room], new[room:]
        plan = self.first_tier(head, protect) if head else None
        moves = list(plan.moves) if plan is not None else []
        around: list[TierWrite] = []
        for lv in self.levels[1:]:
            if not rest:
                break
            if off & lv.bit:
                continue
            fit = self.admission.admitted(lv, rest)
            take = fit[: self.room(lv, protect, len(fit))]
            slots = self.make_room(lv, take, protect, moves) if take else None
            if slots is None:
                continue
            lv.hold(self.present, take, slots)
            around.append(TierWrite(tuple(take), StoreSpec(lv.index, lv.medium, tuple(slots))))
            taken = set(take)
            rest = [k for k in rest if k not in taken]
        if plan is None and not around:
            return None
        if plan is None:
            plan = PrepareStoreOutput((), StoreSpec(0, first.medium, ()), ())
        return PrepareStoreOutput(
            keys_to_store=plan.keys_to_store,
            store_spec=plan.store_spec,
            evicted_keys=plan.evicted_keys,
            moves=tuple(moves),
            around=tuple(around),
        )

    def room(self, level: Level, protect: Collection[bytes], want: int) -> int:
        """How many of `want` new blocks `level` can take: free slots plus evictable ones."""
        free = level.tier.free_blocks
        if want <= free:
            return want
        return min(want, free + level.evictable(self.ready, protect, want - free))

    def make_room(
        self, level: Level, keys: list[bytes], protect: Collection[bytes], moves: list[BlockMove]
    ) -> list[int] | None:
        """Slots for `keys` in `level`, its policy's victims leaving (demoted further down by
        `moves`); None, changing nothing, if it cannot make the room."""
        tier = level.tier
        need = len(keys) - tier.free_blocks
        if need > 0:
            if len(keys) > tier.capacity_blocks:
                return None
            self.adoption.wake_oldest(level, need)
            victims = level.policy.evict(need, level.protected(protect))
            if victims is None:
                return None
            self.evict(level, victims, moves)
        slots = tier.allocate(keys)
        assert slots is not None, f"{level.medium} ran out of slots after eviction"
        return slots

    def evict(self, level: Level, victims: list[bytes], moves: list[BlockMove]) -> None:
        """Remove `victims` (already taken out of the policy) from `level`, demoting those no
        lower tier holds into the next tier that takes them. Deeper moves are appended before
        this level's move: the slots they free may be the ones this level's move writes into."""
        if self.adoption.open_marks:
            self.adoption.send_open(level)
        slots_of = level.slots
        ready, present = self.ready, self.present
        if self.single:  # each victim is ready here and nowhere else: it just goes
            freed_slots = list(map(slots_of.pop, victims))  # `present` too, with one tier
            for k in victims:
                del ready[k]
            level.counters.evictions += len(victims)
            level.counters.dropped += len(victims)
            self.events.append(OffloadingEvent(tuple(victims), level.medium, True))
            level.tier.free(freed_slots)
            return
        bit, lower_mask = level.bit, ~((level.bit << 1) - 1)
        freed: list[int] = []
        demote: list[bytes] = []
        demote_slots: list[int] = []
        below: list[bytes] = []  # held ready below already (written through): no copy
        for k in victims:
            slot = slots_of.pop(k)
            freed.append(slot)
            m = ready[k] & ~bit
            if m:
                ready[k] = m
            else:
                del ready[k]
            p = present[k] & ~bit
            if p & lower_mask:
                present[k] = p
                if m & lower_mask:
                    below.append(k)
                continue
            if p:
                present[k] = p
            else:
                del present[k]
            demote.append(k)
            demote_slots.append(slot)
        level.counters.evictions += len(victims)
        self.events.append(OffloadingEvent(tuple(victims), level.medium, True))
        if level.cold:
            level.cold.difference_update(victims)
        # `below` left this level while a lower tier holds a cold write-through copy: there
        # the copy becomes as recent as a demotion would have made it (now the only copy).
        for lv in self.levels[level.index + 1 :] if below else ():
            below = lv.warm(self.ready, below)
        # The victims go into the first lower tier that admits them and has room, past a
        # suspended one (it hung: a demotion would wait on it) and a full one (its slots taken
        # by blocks in flight: under load, the next tier's stores); what none takes goes.
        off, admission = self.breaker.mask(), self.admission
        out, out_slots = demote, demote_slots
        for lv in self.levels[level.index + 1 :] if demote else ():
            if lv.bit & off:
                continue
            fit = set(admission.admitted(lv, demote) if lv.bit & admission.gated else demote)
            keys = [k for k in demote if k in fit]
            slots = [s for k, s in zip(demote, demote_slots, strict=True) if k in fit]
            if keys and self._demote_into(lv, level, keys, slots, moves):
                rest = [(k, s) for k, s in zip(demote, demote_slots, strict=True) if k not in fit]
                demote, demote_slots = [k for k, _ in rest], [s for _, s in rest]
            if not demote:
                break
        level.counters.dropped += len(demote)
        # Slots go back only after the move is planned: the move reads them first. A moved
        # block's slot is released, not freed: its block stays stored (a kill recovers it)
        # until its move ends and `_complete_multi` settles it (`Tier.release`).
        if out:
            moved = self.released.record(level.index, out, out_slots, demote)
            freed = [s for s in freed if s not in moved]
            level.tier.release(list(moved))
        level.tier.free(freed)

    def _demote_into(
        self,
        dst: Level,
        src: Level,
        keys: list[bytes],
        src_slots: list[int],
        moves: list[BlockMove],
    ) -> bool:
        """Plan a write-back of `keys` into `dst`; False (nothing planned) if it has no room."""
        slots = self.make_room(dst, keys, frozenset(), moves)
        if slots is None:
            return False
        dst.hold(self.present, keys, slots)
        self.moving.update(keys)
        if self.leaving.planning:  # readable from the source slots until the move completes
            self.leaving.leave(src.index, keys, src_slots)
        dst.counters.demoted_in += len(keys)
        moves.append(src.move_to(dst, keys, src_slots, slots))
        return True
