"""`OffloadingManager`: the bookkeeping brain over an ordered list of tiers (fastest first).

It holds keys, slots, states and reference counts, never bytes. Primitives (vLLM's
OffloadingManager shape, on 16-byte prefix keys):
- `lookup(keys) -> int | None`: leading blocks ready in any tier (None: a block of the chain is
  moving between tiers right now; ask again later); `touch(keys)`: mark a chain used;
- `prepare_load(keys) -> LoadSpec` / `complete_load(keys)`: pin blocks while they are read;
- `prepare_store(keys) -> PrepareStoreOutput | None` / `complete_store(keys, success)`:
  two-phase store into the first tier, with eviction and write-back demotion plans; what the
  first tier cannot take goes straight into the next tiers with room (write-around);
- `plan_write_through(limit)` / `complete_write_through(keys, success)`: copies of new
  blocks into write-through tiers, queued (bounded, `through_queue`), run off the caller's path;
- admission on reuse (per tier): a block enters such a tier (demotion, write-around,
  write-through) only once it has been sighted twice (stored or loaded), remembered in a
  bounded ghost map of keys (`admission.Sightings`);
- `prepare_promote(keys)`: copies of lower-tier hits into the first tier; `discard(keys)`:
  drop blocks found corrupt; `take_events()`; `stats()`; a read-only tier is written never;
- `suspend(tier)` / `record_ok(tier)`: the circuit breaker (`breaker`). A tier that
  missed a load deadline is skipped by lookups (and by loads, where a faster or slower copy
  exists) for a back-off period, then tried again by itself.
- leaving blocks (`leaving`): a block that `plan_write_through` or
  `prepare_store(leaving=True)` demotes stays readable from its source slot until its move
  ends: `lookup_ready` and `prepare_load` with `leaving=True` serve it from there and pin
  that slot, which the plan's runner writes only once `reading(tier, slots)` is False.
  Adapters' plans (a transfer engine) do not serve blocks while they move.
- blocks a tier holds unindexed (`adoption`: dormant ones, and other processes' in shared
  tiers): `where` and `first_tiers` wake the blocks asked about; `holds` and `count_ready`
  see dormant blocks without waking them.

Invariants: a block being stored is invisible to lookup until complete_store(success=True);
a pinned block is never evicted; a key already held is not stored again; a prepare that
returns None or raises changes no state (it may wake dormant blocks, which changes no
answer); a key the manager indexes is dormant in no tier. The per-tier state (`Level`:
slots, pins, policy, counters) and the outstanding loads (`Loads`) are `levels`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tiercache.event_log import EventLog
from tiercache.manager.admission import Admission
from tiercache.manager.adoption import Adoption
from tiercache.manager.breaker import CircuitBreaker
from tiercache.manager.copies import Copies
from tiercache.manager.leaving import LeavingBlocks, ReleasedSources
from tiercache.manager.levels import Index, Level, Loads, count_lookup, not_ready, unpin
from tiercache.manager.placement import Placement
from tiercache.manager.through_queue import ThroughQueue
from tiercache.policies import EvictionPolicy
from tiercache.records import BlockMove, LoadSpec, OffloadingEvent, PrepareStoreOutput
from tiercache.tiers import Tier

__all__ = ["OffloadingManager"]


def _seq(keys: Iterable[bytes]) -> Sequence[bytes]:
    return keys if isinstance(keys, (list, tuple)) else list(keys)  # `list | tuple`: slower


class OffloadingManager:
    """Multi-tier bookkeeping: where each key lives, what may be evicted, what to move."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        policies: Sequence[EvictionPolicy],
        *,
        promote: bool = True,
        write_through: Sequence[bool] = (),
        write_through_queue: int = 4096,
        admit_on_reuse: Sequence[bool] = (),
        breaker: CircuitBreaker | None = None,
        events: EventLog | None = None,
    ) -> None:
        """`breaker`: the tiers' circuit breaker (default: 1 s back-off doubling to 30 s).
        `events`: the event queue, bounded (default `EventLog()`, see tiercache.event_log).
        `write_through[i]`: every block stored into a faster tier is also copied into tier
        i (tier 0 never; default none); at most `write_through_queue` blocks wait per tier,
        the ones that do not fit are dropped and counted (`through_dropped`).
        `admit_on_reuse[i]`: tier i (never tier 0) takes only blocks sighted at least twice;
        the sightings of as many keys as the largest such tier holds are remembered."""
        if not tiers:
            raise ValueError("tiers: at least one tier is required")
        if len(tiers) != len(policies):
            raise ValueError(f"policies: expected one per tier ({len(tiers)}), got {len(policies)}")
        pairs = enumerate(zip(tiers, policies, strict=True))
        self._levels = [Level(i, t, p) for i, (t, p) in pairs]
        self._promote = promote
        self._single = len(self._levels) == 1
        self._breaker = breaker or CircuitBreaker(len(tiers))
        self._ready: dict[bytes, int] = {}  # key -> bitmask of tiers where it is ready
        # key -> bitmask of tiers holding it (ready or not). With one tier that is exactly
        # the tier's slot map, so the map serves as both and the bitmask is never built.
        self._present: dict[bytes, int] = self._levels[0].slots if self._single else {}
        self._moving: set[bytes] = set()  # keys being demoted (in no tier's lookup meanwhile)
        self._leaving = LeavingBlocks()  # see the module doc: while their moves run
        self._released = ReleasedSources()  # demoted blocks' sources, kept until settled
        # Outstanding loads: where each reads, and the slots (leaving blocks' too) they pin.
        self._loads = Loads(self._levels)
        self._events = events if events is not None else EventLog()
        # Write-through: per tier, keys waiting for their copy (oldest first, bounded), and
        # the source (tier, key) pinned by each copy in flight.
        self._through = ThroughQueue(write_through, len(tiers), write_through_queue)
        self._admission = Admission(self._levels, admit_on_reuse)
        # What the tiers hold unindexed: recovered at open (adopted now, or dormant), or
        # stored by other processes into shared tiers (see the module doc).
        index = Index(self._levels, self._ready, self._present, self._moving, self._events)
        self._adoption = Adoption(index)
        # The only tier, shared: a one-key first lookup takes `Adoption.take_one`.
        self._lone = self._levels[0] if self._single and self._adoption.shared else None
        # Slot reservation, eviction, demotion; write-through and write-back copies.
        self._placement = Placement(
            index,
            leaving=self._leaving,
            released=self._released,
            breaker=self._breaker,
            admission=self._admission,
            adoption=self._adoption,
        )
        self._copies = Copies(
            index,
            through=self._through,
            admission=self._admission,
            breaker=self._breaker,
            placement=self._placement,
        )

    # -- introspection ---------------------------------------------------------------------
    @property
    def tiers(self) -> list[Tier]:
        return [lv.tier for lv in self._levels]

    @property
    def policies(self) -> list[EvictionPolicy]:
        return [lv.policy for lv in self._levels]

    def where(self, key: bytes, *, leaving: bool = False) -> list[int]:
        """Tiers (indices) where `key` is ready, fastest first. A dormant block is woken: the
        caller is about to use it (verify, load or drop it). `leaving`: a leaving block (see
        the module doc) is where its source slot is."""
        mask = self._ready.get(key, 0)
        if not mask and leaving and key in self._leaving:
            return [self._leaving[key][0]]
        mask = mask or self._adoption.wake_one(key)
        return [lv.index for lv in self._levels if mask & lv.bit]

    def first_tiers(
        self, keys: Sequence[bytes], *, leaving: bool = False, stop: bool = False
    ) -> list[int]:
        """`where(k, leaving=leaving)[0]` of each of `keys` (-1: held nowhere), in one pass;
        `stop`: only up to the first key held nowhere (`Adoption.first_tiers`)."""
        return self._adoption.first_tiers(keys, self._leaving if leaving else {}, stop)

    def is_pending(self, key: bytes) -> bool:
        """Whether `key` is held but not ready anywhere: its store (or a move) is in flight,
        so it will be readable once that completes (vLLM's HIT_PENDING), unless it fails."""
        return key not in self._ready and (key in self._present or key in self._moving)

    def is_moving(self, key: bytes) -> bool:
        """Whether `key` is being moved between tiers (lookups reaching it answer "ask again")."""
        return key in self._moving

    def unmove(self, keys: Iterable[bytes]) -> None:
        """Moves past their deadline (a hung destination tier): their keys read as misses
        from now on, not as "ask again", so no request waits on them. The move still
        completes as usual: the keys are then ready where it wrote them, or gone. Given up,
        a leaving block is no longer served from its source (reads in flight finish)."""
        keys = _seq(keys)
        self._moving.difference_update(keys)
        self._leaving.end(keys)

    def reading(self, tier: int, slots: Sequence[int]) -> bool:
        """Whether one of `slots` of `tier` is busy: a leaving block's source, its move still
        running, or pinned by a read of one. A plan's runner writes them only once this is
        False (see the module doc)."""
        return self._leaving.busy(tier, slots) or self._loads.reading(tier, slots)

    def holds(self, key: bytes) -> bool:
        """Whether some tier holds `key`, ready (dormant included) or with its store (or a
        move) in flight."""
        if key in self._present or key in self._moving:
            return True
        return self._adoption.holds_dormant((key,)) > 0

    def count_ready(self, keys: Iterable[bytes]) -> int:
        """How many of `keys` are ready in some tier, dormant blocks included (no stats, no
        ordering, nothing woken)."""
        keys, ready = _seq(keys), self._ready
        if not self._adoption.sleepers:
            return sum(1 for k in keys if k in ready)
        rest = [k for k in keys if k not in ready]
        return len(keys) - len(rest) + self._adoption.holds_dormant(rest)

    # -- lookup and load -------------------------------------------------------------------
    def lookup(self, keys: Iterable[bytes], *, count: bool = True) -> int | None:
        """Number of leading keys ready in any tier; None when the chain continues with a block
        that is moving between tiers (it will be ready again shortly). On a miss, shared tiers
        are asked for blocks another process stored since they opened (`Adoption.probe`).

        Each key counts as a hit or a miss per tier, unless `count` is False (a caller asking
        again within one request, e.g. the facade's `get` after its `lookup`)."""
        n, moving = self.lookup_ready(keys, count=count)
        return None if moving else n

    def lookup_ready(
        self, keys: Iterable[bytes], *, count: bool = True, leaving: bool = False
    ) -> tuple[int, bool]:
        """`lookup` for callers that use the ready part of a chain even where it continues
        with a moving block (a read, a load planned earlier): the number of leading keys
        ready, and whether the next key is moving (it will be ready again shortly).
        `leaving`: a leaving block (see the module doc) counts as ready in its source tier
        (the caller loads with `prepare_load(leaving=True)`)."""
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)  # `_seq`, inline: hot
        off = self._breaker.mask()
        lone, adoption = self._lone, self._adoption
        if (
            lone is not None
            and len(keys) == 1
            and keys[0] not in self._ready  # (the loop below asks again: a dict now cached)
            and keys[0] not in lone.slots  # nor held (its store in flight): `present`
            and not (off or adoption.sleepers or self._leaving)
            and keys[0] not in self._moving
            and lone.tier.free_blocks
        ):
            # A first lookup of one key after a lazy open: what the rest does for it (the
            # loop's `_discover`: probe, then adopt; the counting) without their steps.
            return adoption.take_one(lone, keys, count), False  # not moving
        get = self._ready.get
        out = self._leaving if leaving else None
        if off or out:  # suspended tiers serve nothing: a block held only there is a miss
            ready = self._ready

            def get(k: bytes) -> int:  # type: ignore[misc]
                m = ready.get(k, 0)
                if not m and out and k in out:
                    m = 1 << out[k][0]
                return m & ~off

        n = 0
        for k in keys:
            if not get(k):
                break
            n += 1
        # Where the ready run stops, a dormant run may continue it, then a run a shared
        # tier holds unindexed, then dormant again (a chain spread over an NVMe and an
        # LMDB tier after a restart): each step indexes at least one key, so this ends.
        while n < len(keys) and (
            (adoption.sleepers and adoption.wake_run(keys, n))
            or (adoption.shared and keys[n] not in self._moving and self._discover(keys, n, off))
        ):
            while n < len(keys) and get(keys[n]):
                n += 1
        missed = len(keys) - n
        if count and self._single:
            c = self._levels[0].counters
            c.hits += n
            c.misses += missed
        elif count:
            count_lookup(self._levels, self._ready, keys, n, missed, off, out)
        return n, bool(missed) and keys[n] in self._moving

    def _discover(self, keys: Sequence[bytes], n: int, off: int = 0) -> int:
        """`lookup` missed at keys[n]: adopt the leading run that a shared tier (fastest
        first, none in the breaker mask `off`) holds unindexed (`Adoption.probe`, `take`).
        Room comes from free slots; in the last tier also from eviction (its victims just go,
        as when it stores). Returns how many keys became ready."""
        adoption, last = self._adoption, self._levels[-1]
        for lv, tail, found in adoption.probe(keys, n, off):
            need = found - lv.tier.free_blocks
            if need > 0 and lv is last:
                adoption.wake_oldest(lv, need)
                victims = lv.policy.evict(need, lv.protected(keys))
                if victims:
                    self._placement.evict(lv, victims, [])
            took = adoption.take(lv, tail, found)
            if took:
                return took
        return 0

    def prepare_load(self, keys: Iterable[bytes], *, leaving: bool = False) -> LoadSpec:
        """Pin each key in the fastest tier where it is ready and say where it lives.
        `leaving`: a leaving block is served from its source slot, which the read pins
        (see the module doc).

        Raises KeyError (and pins nothing) if a key is not ready in any tier.
        """
        keys = tuple(keys)
        if self._single:
            return self._prepare_load_single(keys)
        if self._admission.mask:
            self._admission.seen.sight(keys)
            if self._through.tiers:  # reused now: admitted where it was kept out at its store
                self._copies.queue(0, [k for k in keys if k in self._ready])
        get = self._ready.get
        off = self._breaker.mask()
        out = self._leaving if leaving else {}
        tier_of: list[int] = []
        for k in keys:
            m = get(k)
            if not m and k in out:
                m = 1 << out[k][0]
            if not m:
                raise not_ready(k)
            m = (m & ~off) or m  # from a tier not suspended, where one holds it
            tier_of.append((m & -m).bit_length() - 1)
        slots = self._loads.pin(keys, tier_of, out, self._ready)
        levels = self._levels
        for t in tier_of:
            levels[t].counters.loaded += 1
        return LoadSpec(keys, tuple(tier_of), tuple(slots), tuple(lv.medium for lv in levels))

    def _prepare_load_single(self, keys: tuple[bytes, ...]) -> LoadSpec:
        """prepare_load with one tier: the tier's pin counts are the whole story."""
        lv = self._levels[0]
        ready = self._ready
        for k in keys:
            if k not in ready:
                raise not_ready(k)
        slots = self._loads.pin_single(keys)
        lv.counters.loaded += len(keys)
        return LoadSpec(keys, (0,) * len(keys), slots, (lv.medium,))

    def complete_load(self, keys: Iterable[bytes]) -> None:
        """Unpin blocks pinned by `prepare_load`. Raises KeyError (and unpins nothing) if a key
        has no outstanding load."""
        keys = _seq(keys)
        if self._single:
            self._loads.release_single(keys)
        else:
            self._loads.release(keys)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark a chain used; its first keys end up most recently used in every tier."""
        keys = _seq(keys)
        for lv in self._levels:
            lv.policy.touch(keys)

    # -- store -----------------------------------------------------------------------------
    def prepare_store(
        self, keys: Iterable[bytes], *, leaving: bool = False
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not held anywhere yet, in the first tier; what it cannot
        take (a chain longer than it, or its room held by pinned blocks and stores in flight)
        goes straight into the next tiers with room (write-around, `plan.around`), the
        chain's head placed first, as lookups reach it first. `leaving`: the blocks its moves
        demote are leaving blocks (the caller's runner guards their slots: see the module doc).

        Keys no tier can take are left out of the plan. Returns None, changing nothing, when
        no key can be placed at all. Raises ValueError on duplicate keys.
        """
        keys = _seq(keys)
        distinct = set(keys)
        if len(distinct) != len(keys):
            raise ValueError("prepare_store: keys contain duplicates")
        # A block another process's write removed from a shared store is not held: stored
        # again, not acknowledged from a stale index.
        self._drop_store_removed()
        present = self._present
        new = [k for k in keys if k not in present]
        adoption = self._adoption
        if new and adoption.sleepers and adoption.wake_keys(new):  # held dormant: not stored again
            new = [k for k in keys if k not in present]
        seen = self._admission.seen
        seen_before = seen.sight(new) if self._admission.mask and new else None
        # A suspended tier (its circuit breaker open: it hung) takes no store: its blocks would
        # hold the engine's until it came back. They go around it, or are not stored.
        off = self._breaker.mask()
        with self._leaving.plan(leaving):
            plan = None if off & 1 else self._placement.first_tier(new, distinct)
            if plan is None and new:
                plan = self._placement.around(new, distinct, off)
        if plan is None and seen_before is not None:  # a refusal changes nothing
            seen.unsight(seen_before)
        return plan

    def prepare_promote(
        self, keys: Iterable[bytes], *, leaving: bool = False
    ) -> PrepareStoreOutput | None:
        """Plan copies of keys ready only in lower tiers into the first tier (`leaving`: as
        in `prepare_store`).

        The caller writes the bytes it loaded into `store_spec` and completes the store as
        usual. Returns None when promotion is off, nothing needs promoting, or no room.
        """
        if not self._promote or self._single:
            return None
        keys = _seq(keys)
        ready = self._ready
        present = self._present
        first_bit = self._levels[0].bit
        todo = [k for k in keys if ready.get(k, 0) and not present[k] & first_bit]
        if not todo:
            return None
        with self._leaving.plan(leaving):
            return self._placement.first_tier(todo, keys)

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Finish stores and moves: make the blocks visible, or free their slots on failure.

        Keys with no store in flight are ignored, so a connector may complete a request's keys
        twice (e.g. after a preemption) without harm.
        """
        keys = _seq(keys)
        if success and self._single:
            self._complete_store_single(keys)
            return
        self._complete_multi(keys, success, cold=False)

    def _complete_multi(self, keys: Sequence[bytes], success: bool, *, cold: bool) -> None:
        """complete_store, except a successful one with a single tier (that has its own fast
        path); `cold`: the keys are write-through copies (`insert_cold`)."""
        ready, present = self._ready, self._present
        moving = self._moving
        single = self._single
        for lv in self._levels:
            slots_of, bit = lv.slots, lv.bit
            get = slots_of.get
            done: list[bytes] = []
            # Reverse order: the policy then holds a chain's head as the most recent insert.
            for k in reversed(keys):
                slot = get(k)
                if slot is None or ready.get(k, 0) & bit:
                    continue
                done.append(k)
                if success:
                    ready[k] = ready.get(k, 0) | bit
                else:
                    del slots_of[k]  # with one tier, that was `present` too
                    self._loads.free(lv, slot)
                    if not single:
                        p = present[k] & ~bit
                        if p:
                            present[k] = p
                        else:
                            del present[k]
            if done and moving:  # a leaving block is served from where it now is (or gone)
                moving.difference_update(done)
                self._leaving.end(done)
            if done and self._released:  # moves ended: their sources go now, never before
                for t, (slots, ks) in self._released.take(done).items():
                    self._levels[t].tier.settle(slots, ks)
            if done and success:
                if cold:  # tail first: the chain's tail is evicted first
                    lv.policy.insert_cold(done)
                    lv.cold.update(done)
                else:
                    lv.policy.insert_many(done, new=True)  # not ready here: in no policy
                done.reverse()
                lv.counters.stored += len(done)
                self._events.append(OffloadingEvent(tuple(done), lv.medium, False))
                if self._through.tiers:
                    self._copies.queue(lv.index, done)

    # -- admission on reuse, write-through -------------------------------------------------
    def plan_write_through(self, limit: int) -> list[BlockMove]:
        """Up to `limit` queued write-through copies, oldest first, as moves from the fastest
        tier holding each block (pinned there until the copy completes) into its
        write-through tier, which makes room through its policy (deeper demotions come first
        in the list). Run them in order and complete each with `complete_write_through`.
        The blocks those demotions move out are leaving blocks (see the module doc)."""
        with self._leaving.plan(True):
            return self._copies.plan_through(limit)

    def complete_write_through(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Finish moves of `plan_write_through` (its copies and the demotions they caused):
        the blocks become ready below, or their slots go back, and the sources are unpinned."""
        keys, through = _seq(keys), self._through
        copies = [k for k in keys if through.copying(k)]
        if len(copies) < len(keys):  # demotions the copies caused: ordinary moves
            done = set(copies)
            self.complete_store([k for k in keys if k not in done], success)
        self._complete_multi(copies, success, cold=True)
        for k in keys:
            copy = through.unpin(k)
            if copy is None:
                continue  # a demotion the copy caused, not a copy
            src, dst = copy
            unpin(self._levels[src].pins, k)
            c = self._levels[dst].counters
            if success:
                c.written_through += 1
            else:
                c.through_dropped += 1

    def _complete_store_single(self, keys: Sequence[bytes]) -> None:
        """Successful complete_store with one tier: nothing moves, and no key completed here
        was ready before, so `ready` takes them in one update."""
        lv = self._levels[0]
        held, ready = lv.slots, self._ready
        # reversed: the chain's head becomes the most recent insert
        done = [k for k in reversed(keys) if k in held and k not in ready]
        if done:
            before = len(ready)
            ready.update(dict.fromkeys(done, lv.bit))
            if len(ready) - before != len(done):  # a key given twice completes once
                done = list(dict.fromkeys(done))
            lv.policy.insert_many(done, new=True)  # not ready here: in no policy
            done.reverse()
            lv.counters.stored += len(done)
            self._events.append(OffloadingEvent(tuple(done), lv.medium, False))

    def plan_writeback(self) -> list[BlockMove]:
        """Moves that copy blocks held only in volatile tiers into persistent tiers' free slots,
        most recently stored first, so a graceful restart keeps what fits (`Copies.writeback`).

        Nothing is evicted for them, and nothing goes into a suspended tier (it hung).
        Complete each move with `complete_store(move.keys)`.
        """
        return self._copies.writeback()

    # -- removal, recovery, events, stats --------------------------------------------------
    def discard(self, keys: Iterable[bytes], tier: int | None = None) -> int:
        """Drop ready, unpinned blocks (e.g. found corrupt) from `tier` (default: every tier).

        Returns how many copies were dropped. Pinned copies are kept (ValueError).
        """
        keys = _seq(keys)
        levels = self._levels if tier is None else [self._levels[tier]]
        for lv in levels:
            for k in keys:
                if k in lv.pins:
                    raise ValueError(f"discard: block {k.hex()} is being loaded from {lv.medium}")
        dropped = 0
        for lv in levels if self._adoption.open_marks else ():
            self._adoption.send_open(lv)
        ready, present = self._ready, self._present
        # With one tier, `present` is the slot map, updated by the del below.
        masks = (ready,) if self._single else (ready, present)
        for lv in levels:
            gone: list[bytes] = []
            for k in keys:
                if not ready.get(k, 0) & lv.bit:
                    continue
                slot = lv.slots.pop(k)
                lv.policy.remove(k)
                lv.cold.discard(k)
                self._loads.free(lv, slot)
                for d in masks:
                    m = d[k] & ~lv.bit
                    if m:
                        d[k] = m
                    else:
                        del d[k]
                gone.append(k)
            if gone:
                dropped += len(gone)
                self._events.append(OffloadingEvent(tuple(gone), lv.medium, True))
        return dropped

    def record_error(self, tier: int, n: int = 1) -> None:
        """Count failed transfers or verifications against a tier."""
        self._levels[tier].counters.errors += n

    def suspend(self, tier: int) -> float:
        """Open the circuit breaker of `tier` (a load from it missed its deadline): lookups
        skip it until the back-off ends. Returns the seconds it stays suspended."""
        breaker = self._breaker
        before = breaker.trips[tier]
        seconds = breaker.trip(tier)
        self._levels[tier].counters.suspensions += breaker.trips[tier] - before
        return seconds

    def record_ok(self, tier: int) -> None:
        """A load from `tier` completed in time: its next suspension starts short again."""
        self._breaker.succeeded(tier)

    def suspended(self) -> list[float]:
        """Per tier, seconds it stays suspended (0.0: serving)."""
        return self._breaker.remaining()

    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call, oldest first; blocks a shared store removed (its own
        capacity, another process: `Tier.take_evicted`) leave the index first."""
        for index in list(self._adoption.open_marks):
            self._adoption.send_open(self._levels[index])
        self._drop_store_removed()
        return self._events.take()

    def _drop_store_removed(self) -> None:
        """Drop from the index, reported removed, the blocks each tier's store removed
        without this manager (`Tier.take_evicted`); a pinned one is left: its read drops it."""
        for lv in self._levels:
            if gone := [k for k in lv.tier.take_evicted() if k not in lv.pins]:
                self.discard(gone, lv.index)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier (by medium): capacity, usage and counters."""
        left, through = self._breaker.remaining(), self._through
        return {
            lv.medium: lv.stats(through_queued=through.queued(i), suspended_s=left[i])
            for i, lv in enumerate(self._levels)
        }
