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
  bounded ghost map of keys (`tiercache.admission.Sightings`);
- `prepare_promote(keys)`: copies of lower-tier hits into the first tier; `discard(keys)`:
  drop blocks found corrupt; `take_events()`; `stats()`; a read-only tier is written never;
- `suspend(tier)` / `record_ok(tier)`: the circuit breaker (`tiercache.breaker`). A tier that
  missed a load deadline is skipped by lookups (and by loads, where a faster or slower copy
  exists) for a back-off period, then tried again by itself.
- leaving blocks (`tiercache.leaving`): a block that `plan_write_through` or
  `prepare_store(leaving=True)` demotes stays readable from its source slot until its move
  completes or is given up: `lookup_ready` and `prepare_load` with `leaving=True` serve it
  from there and pin that slot; the plan's runner writes the slot's next block only once
  `reading(tier, slots)` is False (a slot freed meanwhile goes back to its tier when the last
  read ends). Adapters' plans run on a transfer engine whose store into the slot waits only
  for the move's read: their blocks are not served while they move.
- dormant blocks: what a persistent tier recovered at open without handing it over
  (`Tier.open_columns`, tiers/dormant.py). The manager keeps no state for them: a lookup or a
  store that reaches one wakes it (adopts it, in every tier holding it dormant), and a tier
  that needs room wakes its oldest ones first as its policy's first victims. `where` (and
  `first_tiers`, over many keys) wakes the block it is asked about (its caller is about to
  use it); `holds` and `count_ready` see dormant blocks without waking them.

Invariants: a block being stored is invisible to lookup until complete_store(success=True);
a pinned block is never evicted; a key already held is not stored again; a prepare that
returns None or raises changes no state (it may wake dormant blocks, which changes no
answer); a key the manager indexes is dormant in no tier. The per-tier state (`Level`:
slots, pins, policy, counters) and the outstanding loads (`Loads`) are `tiercache.levels`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from tiercache.event_log import EventLog
from tiercache.policies import EvictionPolicy
from tiercache.records import (
    BlockMove,
    LoadSpec,
    OffloadingEvent,
    PrepareStoreOutput,
    StoreSpec,
    TierWrite,
)
from tiercache.tiers import Tier

from .admission import Sightings, admit_flags
from .breaker import CircuitBreaker
from .leaving import LeavingBlocks, ReleasedSources
from .levels import Level, Loads, TierCounters, count_lookup, first_tiers, not_ready, unpin
from .through_queue import ThroughQueue

__all__ = ["OffloadingManager", "TierCounters"]  # TierCounters: tiercache.levels, re-exported


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
        # Tiers other processes write into: a lookup miss asks them (see _discover).
        self._shared = [lv for lv in self._levels if lv.tier.shared]
        self._lone = self._levels[0] if self._single and self._shared else None
        # Write-through: per tier, keys waiting for their copy (oldest first, bounded), and
        # the source (tier, key) pinned by each copy in flight.
        self._through = ThroughQueue(write_through, len(tiers), write_through_queue)
        admit = admit_flags(admit_on_reuse, len(tiers))
        self._admit_mask = sum(lv.bit for lv in self._levels if admit[lv.index])
        # Tiers a demotion asks (`_admitted`): admitting on reuse, or read-only.
        self._gated = self._admit_mask | sum(lv.bit for lv in self._levels if lv.tier.read_only)
        # The admission ghosts: sightings of as many keys as the largest admitting tier holds.
        self._seen = Sightings(
            max((lv.tier.capacity_blocks for lv in self._levels if admit[lv.index]), default=0)
        )
        for level in self._levels:
            self._adopt(level, *level.tier.open_columns())
        # Tiers holding blocks dormant since their open (tiers/dormant.py): no per-key state
        # here until a lookup or a store reaches a key (`_wake_run`, `_wake_keys`) or the
        # tier needs room (`_wake_oldest`: dormant blocks are the least recently used). Their
        # stored event keeps its place in the queue, its keys listed when it is taken or
        # before a slot of theirs is freed (`_send_open`).
        self._sleepers = [lv for lv in self._levels if lv.tier.dormant_blocks]
        self._open_marks: dict[int, int] = {}  # tier -> its open event's place in _events
        for level in self._sleepers:
            self._open_marks[level.index] = len(self._events)
            self._events.append(OffloadingEvent((), level.medium, False))

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
        asleep = not mask and self._sleepers and key not in self._present
        if asleep and key not in self._moving and self._wake_keys((key,)):
            mask = self._ready.get(key, 0)
        return [lv.index for lv in self._levels if mask & lv.bit]

    def first_tiers(
        self, keys: Sequence[bytes], *, leaving: bool = False, stop: bool = False
    ) -> list[int]:
        """`where(k, leaving=leaving)[0]` of each of `keys`, in one pass (levels.first_tiers)."""
        return first_tiers(self._ready, lambda k: self.where(k, leaving=leaving), keys, stop)

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
        return any(lv.tier.find_dormant((key,))[0] >= 0 for lv in self._sleepers)

    def count_ready(self, keys: Iterable[bytes]) -> int:
        """How many of `keys` are ready in some tier, dormant blocks included (no stats, no
        ordering, nothing woken)."""
        keys, ready = _seq(keys), self._ready
        if not self._sleepers:
            return sum(1 for k in keys if k in ready)
        rest = [k for k in keys if k not in ready]
        found = [False] * len(rest)
        for lv in self._sleepers:
            found = [f or s >= 0 for f, s in zip(found, lv.tier.find_dormant(rest), strict=True)]
        return len(keys) - len(rest) + sum(found)

    # -- lookup and load -------------------------------------------------------------------
    def lookup(self, keys: Iterable[bytes], *, count: bool = True) -> int | None:
        """Number of leading keys ready in any tier; None when the chain continues with a block
        that is moving between tiers (it will be ready again shortly). On a miss, shared tiers
        are asked for blocks another process stored since they opened (see `_discover`).

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
        lone = self._lone
        if (
            lone is not None
            and len(keys) == 1
            and keys[0] not in self._ready  # (the loop below asks again: a dict now cached)
            and keys[0] not in lone.slots  # nor held (its store in flight): `present`
            and not (off or self._sleepers or self._leaving)
            and keys[0] not in self._moving
            and lone.tier.free_blocks
        ):
            # A first lookup of one key after a lazy open: what the rest does for it (the
            # loop's `_discover`: probe, then adopt; the counting) without their steps.
            return lone.take_one(self._ready, keys, self._events, count), False  # not moving
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
            (self._sleepers and self._wake_run(keys, n))
            or (self._shared and keys[n] not in self._moving and self._discover(keys, n, off))
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
        """`lookup` missed at keys[n]: ask the shared tiers, fastest first, for blocks another
        process stored there after they opened, and adopt the leading run one of them holds.
        Room comes from free slots; in the last tier also from eviction (its victims just
        go, as when it stores). Suspended tiers (`off`) are not asked. Returns how many keys
        became ready."""
        present = self._present
        tail = keys[n:] if n else keys
        for i, k in enumerate(tail):
            if k in present:  # held here already, its store or move still in flight
                tail = tail[:i]
                break
        for lv in self._shared if tail else ():
            if off & lv.bit:
                continue
            tier = lv.tier
            found = tier.probe(tail)
            if not found:
                continue
            free = tier.free_blocks
            if found > free and lv is self._levels[-1]:
                self._wake_oldest(lv, found - free)
                victims = lv.policy.evict(found - free, lv.protected(keys))
                if victims:
                    self._evict(lv, victims, [])
                free = tier.free_blocks
            take = tail if found == len(tail) <= free else tail[: min(found, free)]
            took = self._adopt_found(lv, take) if take else 0
            if took:
                return took
        return 0

    def _adopt_found(self, lv: Level, take: Sequence[bytes]) -> int:
        """Adopt `take`, leading keys a probe of shared `lv` found (room made): how many."""
        slots, n = lv.tier.adopt(take), len(take)
        if not slots:
            return 0
        # Tail first into the policy, so the chain's head ends up most recently used.
        self._adopt(lv, take[::-1], slots[::-1]) if n > 1 else self._adopt(lv, take, slots)
        lv.counters.discovered += n
        return n

    def _wake_run(self, keys: Sequence[bytes], n: int) -> int:
        """`lookup` stopped at keys[n]: take over the leading run of the keys from there that
        no tier indexes here but some tier holds dormant, in every tier holding each (the
        chain's head ends up most recently used). Returns the run's length."""
        present, moving = self._present, self._moving
        tail: list[bytes] = []
        for k in keys[n:]:
            if k in present or k in moving:
                break
            tail.append(k)
        if not tail:
            return 0
        if len(self._sleepers) == 1:  # one persistent tier: the same run, no per-tier lists
            lv = self._sleepers[0]
            slots = lv.tier.find_dormant(tail)
            run = 0
            while run < len(tail) and slots[run] >= 0:
                run += 1
            return self._wake(lv, tail[:run], slots[:run])
        found = [(lv, lv.tier.find_dormant(tail)) for lv in self._sleepers]
        run = 0
        while run < len(tail) and any(slots[run] >= 0 for _, slots in found):
            run += 1
        self._wake_found(tail[:run], found)
        return run

    def _wake_keys(self, keys: Sequence[bytes], skip: Level | None = None) -> int:
        """Take over every one of `keys` (distinct, none indexed here) some tier other than
        `skip` holds dormant; returns how many copies were woken."""
        found = [(lv, lv.tier.find_dormant(keys)) for lv in self._sleepers if lv is not skip]
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
        self._adopt(level, list(keys[::-1]), list(slots[::-1]), event=False)
        if not level.tier.dormant_blocks:
            self._sleepers.remove(level)
        return len(keys)

    def _wake_oldest(self, level: Level, n: int) -> None:
        """`level` must evict `n` blocks: its oldest dormant ones (least recently used) are
        taken over first, as its policy's first victims, and their copies dormant in other
        tiers with them (a key is held dormant nowhere once it is indexed here)."""
        if n <= 0 or not level.tier.dormant_blocks:
            return
        keys, slots = level.tier.wake_oldest(n)
        if not level.tier.dormant_blocks:
            self._sleepers.remove(level)
        self._adopt(level, keys, slots, event=False, cold=True)
        if self._sleepers:
            self._wake_keys(keys, skip=level)

    def _send_open(self, level: Level) -> None:
        """List the keys of `level`'s open event (left dormant at open), in its place in the
        queue: when events are taken, or before a slot of the level is freed (a write into
        it would change the key the tier reads there)."""
        at = self._open_marks.pop(level.index, None)
        if at is not None:
            keys = tuple(level.tier.open_keys())
            self._events[at] = OffloadingEvent(keys, level.medium, False)

    def prepare_load(self, keys: Iterable[bytes], *, leaving: bool = False) -> LoadSpec:
        """Pin each key in the fastest tier where it is ready and say where it lives.
        `leaving`: a leaving block is served from its source slot, which the read pins
        (see the module doc).

        Raises KeyError (and pins nothing) if a key is not ready in any tier.
        """
        keys = tuple(keys)
        if self._single:
            return self._prepare_load_single(keys)
        if self._admit_mask:
            self._seen.sight(keys)
            if self._through.tiers:  # reused now: admitted where it was kept out at its store
                self._queue_through(0, [k for k in keys if k in self._ready])
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
        present = self._present
        distinct = set(keys)
        if len(distinct) != len(keys):
            raise ValueError("prepare_store: keys contain duplicates")
        new = [k for k in keys if k not in present]
        if new and self._sleepers and self._wake_keys(new):  # held dormant: not stored again
            new = [k for k in keys if k not in present]
        seen_before = self._seen.sight(new) if self._admit_mask and new else None
        # A suspended tier (its circuit breaker open: it hung) takes no store: its blocks would
        # hold the engine's until it came back. They go around it, or are not stored.
        off = self._breaker.mask()
        with self._leaving.plan(leaving):
            plan = None if off & 1 else self._reserve_first_tier(new, distinct)
            if plan is None and new:
                plan = self._reserve_around(new, distinct, off)
        if plan is None and seen_before is not None:  # a refusal changes nothing
            self._seen.unsight(seen_before)
        return plan

    def _reserve_around(
        self, new: list[bytes], protect: Collection[bytes], off: int = 0
    ) -> PrepareStoreOutput | None:
        """`new` does not fit the first tier: its head goes there as far as room can be made,
        the rest into the lower tiers in order, each making room through its policy. Tiers
        in the breaker mask `off` are skipped."""
        first = self._levels[0]
        room = 0 if off & first.bit else self._room(first, protect, len(new))
        head, rest = new[:room], new[room:]
        plan = self._reserve_first_tier(head, protect) if head else None
        moves = list(plan.moves) if plan is not None else []
        around: list[TierWrite] = []
        for lv in self._levels[1:]:
            if not rest:
                break
            if off & lv.bit:
                continue
            fit = self._admitted(lv, rest)
            take = fit[: self._room(lv, protect, len(fit))]
            slots = self._make_room(lv, take, protect, moves) if take else None
            if slots is None:
                continue
            lv.hold(self._present, take, slots)
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

    def _room(self, level: Level, protect: Collection[bytes], want: int) -> int:
        """How many of `want` new blocks `level` can take: free slots plus evictable ones."""
        free = level.tier.free_blocks
        if want <= free:
            return want
        return min(want, free + level.evictable(self._ready, protect, want - free))

    def _make_room(
        self, level: Level, keys: list[bytes], protect: Collection[bytes], moves: list[BlockMove]
    ) -> list[int] | None:
        """Slots for `keys` in `level`, its policy's victims leaving (demoted further down by
        `moves`); None, changing nothing, if it cannot make the room."""
        tier = level.tier
        need = len(keys) - tier.free_blocks
        if need > 0:
            if len(keys) > tier.capacity_blocks:
                return None
            self._wake_oldest(level, need)
            victims = level.policy.evict(need, level.protected(protect))
            if victims is None:
                return None
            self._evict(level, victims, moves)
        slots = tier.allocate(keys)
        assert slots is not None, f"{level.medium} ran out of slots after eviction"
        return slots

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
            return self._reserve_first_tier(todo, keys)

    def _reserve_first_tier(
        self, new: list[bytes], protect: Collection[bytes]
    ) -> PrepareStoreOutput | None:
        first = self._levels[0]
        tier = first.tier
        need = len(new) - tier.free_blocks
        # Refusals first, before the policy hears of the miss: a None changes nothing, ARC's
        # p and ghost lists included.
        if need > 0 and (
            len(new) > tier.capacity_blocks or first.evictable(self._ready, protect, need) < need
        ):
            return None
        if new:  # before evict: ARC adapts p for ghost hits first, as the paper orders it
            first.policy.on_miss(new)
        victims: list[bytes] = []
        if need > 0:
            self._wake_oldest(first, need)
            got = first.policy.evict(need, first.protected(protect))
            if got is None:  # a policy that refuses what it holds unprotected (see Level.evictable)
                return None
            victims = got
        # From here on nothing fails: every state change below is committed together.
        moves: list[BlockMove] = []
        if victims:
            self._evict(first, victims, moves)
        slots = tier.allocate(new)
        assert slots is not None, "first tier ran out of slots after eviction"
        first.slots.update(zip(new, slots, strict=True))  # with one tier: `present` too
        if not self._single:
            present = self._present
            bit = first.bit
            for k in new:
                present[k] = present.get(k, 0) | bit
        return PrepareStoreOutput(
            keys_to_store=tuple(new),
            store_spec=StoreSpec(0, first.medium, tuple(slots)),
            evicted_keys=tuple(victims),
            moves=tuple(moves),
        )

    def _evict(self, level: Level, victims: list[bytes], moves: list[BlockMove]) -> None:
        """Remove `victims` (already taken out of the policy) from `level`, demoting those no
        lower tier holds into the next tier that takes them. Deeper moves are appended before
        this level's move: the slots they free may be the ones this level's move writes into."""
        if self._open_marks:
            self._send_open(level)
        slots_of = level.slots
        ready, present = self._ready, self._present
        if self._single:  # each victim is ready here and nowhere else: it just goes
            freed_slots = list(map(slots_of.pop, victims))  # `present` too, with one tier
            for k in victims:
                del ready[k]
            level.counters.evictions += len(victims)
            level.counters.dropped += len(victims)
            self._events.append(OffloadingEvent(tuple(victims), level.medium, True))
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
        self._events.append(OffloadingEvent(tuple(victims), level.medium, True))
        if level.cold:
            level.cold.difference_update(victims)
        # `below` left this level while a lower tier holds a cold write-through copy: there
        # the copy becomes as recent as a demotion would have made it (now the only copy).
        for lv in self._levels[level.index + 1 :] if below else ():
            below = lv.warm(self._ready, below)
        # The victims go into the first lower tier that admits them and has room, past a
        # suspended one (it hung: a demotion would wait on it) and a full one (its slots taken
        # by blocks in flight: under load, the next tier's stores); what none takes goes.
        off = self._breaker.mask()
        out, out_slots = demote, demote_slots
        for lv in self._levels[level.index + 1 :] if demote else ():
            if lv.bit & off:
                continue
            fit = set(self._admitted(lv, demote) if lv.bit & self._gated else demote)
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
            moved = self._released.record(level.index, out, out_slots, demote)
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
        slots = self._make_room(dst, keys, frozenset(), moves)
        if slots is None:
            return False
        dst.hold(self._present, keys, slots)
        self._moving.update(keys)
        if self._leaving.planning:  # readable from the source slots until the move completes
            self._leaving.leave(src.index, keys, src_slots)
        dst.counters.demoted_in += len(keys)
        moves.append(src.move_to(dst, keys, src_slots, slots))
        return True

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
                    self._queue_through(lv.index, done)

    # -- admission on reuse, write-through -------------------------------------------------
    def _admitted(self, level: Level, keys: Sequence[bytes]) -> list[bytes]:
        """The keys `level` takes: all, none (read-only), or with admission on reuse those
        sighted twice (the rest are counted as not admitted)."""
        if level.tier.read_only:
            return []
        if not level.bit & self._admit_mask:
            return list(keys)
        out = self._seen.reused(keys)
        level.counters.not_admitted += len(keys) - len(out)
        return out

    def _queue_through(self, stored_in: int, keys: Sequence[bytes]) -> None:
        """Keys just stored in tier `stored_in` wait for their copy into each write-through
        tier below it that does not hold them; past the bound they are dropped, counted."""
        present, through = self._present, self._through
        for t in through.below(stored_in):
            lv = self._levels[t]
            queue, bit = through.queue(t), lv.bit
            todo = [k for k in keys if not present[k] & bit and k not in queue]
            if bit & self._admit_mask:
                todo = self._admitted(lv, todo)
            lv.counters.through_dropped += through.offer(t, todo)

    def through_backlog(self) -> int:
        """Blocks waiting for a write-through copy, over all tiers."""
        return self._through.backlog()

    def plan_write_through(self, limit: int) -> list[BlockMove]:
        """Up to `limit` queued write-through copies, oldest first, as moves from the fastest
        tier holding each block (pinned there until the copy completes) into its
        write-through tier, which makes room through its policy (deeper demotions come first
        in the list). Run them in order and complete each with `complete_write_through`.
        The blocks those demotions move out are leaving blocks (see the module doc)."""
        with self._leaving.plan(True):
            return self._plan_write_through(limit)

    def _plan_write_through(self, limit: int) -> list[BlockMove]:
        moves: list[BlockMove] = []
        ready, present = self._ready, self._present
        off, through = self._breaker.mask(), self._through
        for t in through.tiers:
            dst = self._levels[t]
            if off & dst.bit:  # suspended (it hung): its copies wait in the queue
                continue
            above = dst.bit - 1
            by_src: dict[int, list[bytes]] = {}
            while limit > 0:
                k = through.pop(t)
                if k is None:
                    break
                m = ready.get(k, 0) & above
                if not m or present[k] & dst.bit:  # gone, or there already (stored, demoted)
                    continue
                by_src.setdefault((m & -m).bit_length() - 1, []).append(k)
                limit -= 1
            for src_index, keys in by_src.items():
                src = self._levels[src_index]
                slots = self._make_room(dst, keys, frozenset(keys), moves)
                if slots is None:
                    dst.counters.through_dropped += len(keys)
                    continue
                dst.hold(self._present, keys, slots)
                for k in keys:  # the source slot stays put until the copy has read it
                    src.pins[k] = src.pins.get(k, 0) + 1
                through.pin(keys, src_index, t)
                moves.append(src.move_to(dst, keys, map(src.slots.__getitem__, keys), slots))
        return moves

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
        most recently stored first, so a graceful restart keeps what fits.

        Nothing is evicted for them, and nothing goes into a suspended tier (it hung).
        Complete each move with `complete_store(move.keys)`.
        """
        off = self._breaker.mask()
        ok = [lv for lv in self._levels if not (off & lv.bit or lv.tier.read_only)]
        persistent = [lv for lv in ok if lv.tier.persistent]
        if not persistent:
            return []
        pmask = sum(lv.bit for lv in persistent)
        moves: list[BlockMove] = []
        taken: set[bytes] = set()
        for src in self._levels:
            if src.tier.persistent:
                continue
            ready, sbit = self._ready, src.bit
            todo = [
                k
                for k in reversed(src.slots)
                if ready.get(k, 0) & sbit and k not in taken and not self._present[k] & pmask
            ]
            for dst in persistent:
                room = dst.tier.free_blocks
                if not todo or not room:
                    continue
                batch, todo = todo[:room], todo[room:]
                taken.update(batch)
                slots = dst.tier.allocate(batch)
                assert slots is not None
                for k, s in zip(batch, slots, strict=True):
                    dst.slots[k] = s
                    self._present[k] |= dst.bit
                moves.append(src.move_to(dst, batch, map(src.slots.__getitem__, batch), slots))
        return moves

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
        for lv in levels if self._open_marks else ():
            self._send_open(lv)
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

    def _adopt(
        self,
        level: Level,
        keys: Sequence[bytes],
        slots: Sequence[int],
        *,
        event: bool = True,
        cold: bool = False,
    ) -> None:
        """Take over blocks a persistent tier recovered on open (or a shared tier's probe
        found, or a dormant block woken), oldest first (`Level.adopt`; `cold`: as the policy's
        first victims). `event`: emit their stored event (a woken block's was at open)."""
        if keys:
            level.adopt(self._ready, self._present, keys, slots, single=self._single, cold=cold)
            if event:
                self._events.append(OffloadingEvent(tuple(keys), level.medium, False))

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
        """Events since the last call, oldest first; blocks a store dropped by its own
        capacity (`Tier.take_evicted`) leave the index first (a pinned one: its read drops it)."""
        for index in list(self._open_marks):
            self._send_open(self._levels[index])
        for lv in self._levels:
            if gone := [k for k in lv.tier.take_evicted() if k not in lv.pins]:
                self.discard(gone, lv.index)
        return self._events.take()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier (by medium): capacity, usage and counters."""
        left, through = self._breaker.remaining(), self._through
        return {
            lv.medium: lv.stats(through_queued=through.queued(i), suspended_s=left[i])
            for i, lv in enumerate(self._levels)
        }
