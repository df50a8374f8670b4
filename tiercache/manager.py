"""`OffloadingManager`: the bookkeeping brain over an ordered list of tiers (fastest first).

It holds keys, slots, states and reference counts, never bytes. Primitives (vLLM's
OffloadingManager shape, on 16-byte prefix keys):
- `lookup(keys) -> int | None`: leading blocks ready in any tier (None: a block of the chain is
  moving between tiers right now; ask again later);
- `prepare_load(keys) -> LoadSpec` / `complete_load(keys)`: pin blocks while they are read;
- `touch(keys)`: mark a chain used, head most recently;
- `prepare_store(keys) -> PrepareStoreOutput | None` / `complete_store(keys, success)`:
  two-phase store into the first tier, with eviction and write-back demotion plans; what the
  first tier cannot take goes straight into the next tiers with room (write-around);
- `plan_write_through(limit)` / `complete_write_through(keys, success)`: copies of newly
  stored blocks into write-through tiers, queued (bounded) and run off the caller's path;
- admission on reuse (per tier): a block enters such a tier (demotion, write-around,
  write-through) only once it has been sighted twice (stored or loaded), remembered in a
  bounded ghost map of keys;
- `prepare_promote(keys)`: plan copies of lower-tier hits into the first tier;
- `discard(keys)`: drop blocks found corrupt; `take_events()`; `stats()`;
- `suspend(tier)` / `record_ok(tier)`: the circuit breaker (`tiercache.breaker`). A tier that
  missed a load deadline is skipped by lookups (and by loads, where a faster or slower copy
  exists) for a back-off period, then tried again by itself.
- leaving blocks: a block that the write-through plan (`plan_write_through`) demotes stays
  readable from its source slot until its move completes or is given up: `lookup_ready` and
  `prepare_load` with `leaving=True` serve it from there and pin that slot (`reading`), and
  the runner of the plan writes the slot's next block only once no read pins it (a slot
  freed meanwhile goes back to its tier when the last read ends). Other plans' moves are run
  by a transfer engine whose store into the slot waits only for the move's read, so their
  blocks are not served while they move.

- dormant blocks: what a persistent tier recovered at open without handing it over
  (`Tier.open_columns`, tiers/dormant.py). The manager keeps no state for them: a lookup or a
  store that reaches one wakes it (adopts it, in every tier holding it dormant), and a tier
  that needs room wakes its oldest ones first as its policy's first victims. `where` wakes
  the block it is asked about (its caller is about to use it); `holds` and `count_ready`
  see dormant blocks without waking them.

Invariants: a block being stored is invisible to lookup until complete_store(success=True);
a pinned block is never evicted; a key already held is not stored again; a prepare that
returns None or raises changes no state (it may wake dormant blocks, which changes no
answer); a key the manager indexes is dormant in no tier.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Container, Iterable, Sequence
from dataclasses import dataclass

from tiercache.breaker import CircuitBreaker
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


class _Level:
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


def _seq(keys: Iterable[bytes]) -> Sequence[bytes]:
    return keys if isinstance(keys, list | tuple) else list(keys)


def _check_loads(
    keys: Sequence[bytes], pins: Container[bytes], loads: Callable[[bytes], int]
) -> None:
    """Raise KeyError, before anything is unpinned, unless every key has an outstanding load
    for each time it is given; `pins` holds the keys with any, `loads(key)` counts them."""
    if len(set(keys)) == len(keys):  # distinct keys: one outstanding load each suffices
        for k in keys:
            if k not in pins:
                raise _no_load(k)
        return
    need: dict[bytes, int] = {}
    for k in keys:
        need[k] = need.get(k, 0) + 1
        if loads(k) < need[k]:
            raise _no_load(k)


def _no_load(key: object) -> KeyError:
    shown = key.hex() if isinstance(key, bytes) else repr(key)
    return KeyError(f"complete_load: block {shown} has no outstanding load")


def _unpin(pins: dict[bytes, int], key: bytes) -> None:
    """Drop one outstanding load of `key` (a key leaves the map when its last load ends)."""
    n = pins[key] - 1
    if n:
        pins[key] = n
    else:
        del pins[key]


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
    ) -> None:
        """`breaker`: the tiers' circuit breaker (default: 1 s back-off doubling to 30 s).
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
        self._levels = [_Level(i, t, p) for i, (t, p) in pairs]
        self._promote = promote
        self._single = len(self._levels) == 1
        self._breaker = breaker or CircuitBreaker(len(tiers))
        self._ready: dict[bytes, int] = {}  # key -> bitmask of tiers where it is ready
        # key -> bitmask of tiers holding it (ready or not). With one tier that is exactly
        # the tier's slot map, so the map serves as both and the bitmask is never built.
        self._present: dict[bytes, int] = self._levels[0].slots if self._single else {}
        self._moving: set[bytes] = set()  # keys being demoted (in no tier's lookup meanwhile)
        # Leaving blocks (see the module doc): moving key -> (source tier, source slot), while
        # the move runs; (tier, slot) -> reads of it in flight; slots whose free waits for
        # them; whether the plan being made creates leaving blocks.
        self._leaving: dict[bytes, tuple[int, int]] = {}
        self._reads: dict[tuple[int, int], int] = {}
        self._free_later: set[tuple[int, int]] = set()
        self._leave = False
        # key -> tier of each outstanding load (multi); (tier, slot) for a leaving block's
        self._pins: dict[bytes, list[int | tuple[int, int]]] = {}
        self._events: list[OffloadingEvent] = []
        # Tiers other processes write into: a lookup miss asks them (see _discover).
        self._shared = [lv for lv in self._levels if lv.tier.shared]
        through = list(write_through) or [False] * len(tiers)
        if len(through) != len(tiers) or through[0]:
            raise ValueError(
                "write_through: one flag per tier, and the first tier cannot be written through"
            )
        if write_through_queue < 1:
            raise ValueError(f"write_through_queue: expected >= 1, got {write_through_queue}")
        # Write-through: per tier, keys waiting for their copy (oldest first, bounded), and
        # the source (tier, key) pinned by each copy in flight.
        self._through = {lv.index: dict[bytes, None]() for lv in self._levels if through[lv.index]}
        self._through_max = write_through_queue
        self._through_pins: dict[bytes, list[tuple[int, int]]] = {}  # key -> (src, dst) each
        admit = list(admit_on_reuse) or [False] * len(tiers)
        if len(admit) != len(tiers) or admit[0]:
            raise ValueError(
                "admit_on_reuse: one flag per tier, and the first tier admits every store"
            )
        self._admit_mask = sum(lv.bit for lv in self._levels if admit[lv.index])
        # key -> sightings (stores and loads), oldest first, bounded: the admission ghosts.
        self._seen: dict[bytes, int] = {}
        self._seen_max = max(
            (lv.tier.capacity_blocks for lv in self._levels if admit[lv.index]), default=0
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
        if (
            not mask
            and self._sleepers
            and key not in self._present
            and key not in self._moving
            and self._wake_keys((key,))
        ):
            mask = self._ready.get(key, 0)
        return [lv.index for lv in self._levels if mask & lv.bit]

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
        if self._leaving:
            for k in keys:
                self._leaving.pop(k, None)

    def reading(self, tier: int, slots: Iterable[int]) -> bool:
        """Whether a read of a leaving block pins one of `slots` of `tier`: the plan's runner
        writes into them only once this is False (see the module doc)."""
        reads = self._reads
        return bool(reads) and any((tier, s) in reads for s in slots)

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
        keys = _seq(keys)
        off = self._breaker.mask()
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
        # Where the ready run stops, a dormant run may continue it, then a run a shared tier
        # holds unindexed, then dormant again (a chain spread over an NVMe and an LMDB tier
        # after a restart): each step indexes at least one key, so this ends.
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
            self._count_lookup(keys, n, missed, off, out)
        return n, bool(missed) and keys[n] in self._moving

    def _discover(self, keys: Sequence[bytes], n: int, off: int = 0) -> int:
        """`lookup` missed at keys[n]: ask the shared tiers, fastest first, for blocks another
        process stored there after they opened, and adopt the leading run one of them holds.
        Room comes from free slots; in the last tier also from eviction (its victims just
        go, as when it stores). Suspended tiers (`off`) are not asked. Returns how many keys
        became ready."""
        present = self._present
        tail: list[bytes] = []
        for k in keys[n:]:
            if k in present:  # held here already, its store or move still in flight
                break
            tail.append(k)
        if not tail:
            return 0
        last = self._levels[-1]
        for lv in self._shared:
            if off & lv.bit:
                continue
            tier = lv.tier
            found = tier.probe(tail)
            if not found:
                continue
            short = found - tier.free_blocks
            if short > 0 and lv is last:
                self._wake_oldest(lv, short)
                victims = lv.policy.evict(short, self._protected(keys, lv))
                if victims:
                    self._evict(lv, victims, [])
            take = tail[: min(found, tier.free_blocks)]
            slots = tier.adopt(take) if take else None
            if not slots:
                continue
            # Tail first into the policy, so the chain's head ends up most recently used.
            self._adopt(lv, take[::-1], slots[::-1])
            lv.counters.discovered += len(take)
            return len(take)
        return 0

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
        if len(self._sleepers) == 1:  # one persistent tier: 20 % faster first lookups
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

    def _wake_keys(self, keys: Sequence[bytes], skip: _Level | None = None) -> int:
        """Take over every one of `keys` (distinct, none indexed here) some tier other than
        `skip` holds dormant; returns how many copies were woken."""
        found = [(lv, lv.tier.find_dormant(keys)) for lv in self._sleepers if lv is not skip]
        return self._wake_found(keys, found)

    def _wake_found(self, keys: Sequence[bytes], found: list[tuple[_Level, list[int]]]) -> int:
        """Wake, in each level, those of `keys` its `find_dormant` answer (slots, -1 for
        none; it may run past `keys`) gives a slot; returns how many copies were woken."""
        woken = 0
        for lv, slots in found:
            here = [i for i in range(len(keys)) if slots[i] >= 0]
            woken += self._wake(lv, [keys[i] for i in here], [slots[i] for i in here])
        return woken

    def _wake(self, level: _Level, keys: Sequence[bytes], slots: Sequence[int]) -> int:
        """Take over dormant blocks `keys` in `slots` of `level`, the first most recently
        used."""
        if not keys:
            return 0
        level.tier.wake(slots)
        self._adopt(level, list(keys[::-1]), list(slots[::-1]), event=False)
        if not level.tier.dormant_blocks:
            self._sleepers.remove(level)
        return len(keys)

    def _wake_oldest(self, level: _Level, n: int) -> None:
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

    def _send_open(self, level: _Level) -> None:
        """List the keys of `level`'s open event (left dormant at open), in its place in the
        queue: when events are taken, or before a slot of the level is freed (a write into
        it would change the key the tier reads there)."""
        at = self._open_marks.pop(level.index, None)
        if at is not None:
            keys = tuple(level.tier.open_keys())
            self._events[at] = OffloadingEvent(keys, level.medium, False)

    def _count_lookup(
        self,
        keys: Sequence[bytes],
        n: int,
        missed: int,
        off: int = 0,
        leaving: dict[bytes, tuple[int, int]] | None = None,
    ) -> None:
        ready = self._ready
        per_tier = [0] * len(self._levels)
        for k in keys[:n]:
            m = ready[k] if leaving is None or k in ready else 1 << leaving[k][0]
            m &= ~off
            per_tier[(m & -m).bit_length() - 1] += 1
        served_below = n
        for lv, hits in zip(self._levels, per_tier, strict=True):
            served_below -= hits
            lv.counters.hits += hits
            lv.counters.misses += missed + served_below

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
            self._sight(keys)
            if self._through:  # reused now: admitted where it was kept out at its store
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
                raise KeyError(
                    f"prepare_load: block {k.hex() if isinstance(k, bytes) else k!r} "
                    "is not ready in any tier"
                )
            m = (m & ~off) or m  # from a tier not suspended, where one holds it
            tier_of.append((m & -m).bit_length() - 1)
        levels = self._levels
        pins = self._pins
        slots: list[int] = []
        for k, t in zip(keys, tier_of, strict=True):
            lv = levels[t]
            pin: int | tuple[int, int] = t
            if k in out and not self._ready.get(k, 0):  # leaving: its source slot is pinned
                pin = out[k]
                self._reads[pin] = self._reads.get(pin, 0) + 1
                slots.append(pin[1])
            else:
                lv.pins[k] = lv.pins.get(k, 0) + 1
                slots.append(lv.slots[k])
            p = pins.get(k)
            if p is None:
                pins[k] = [pin]
            else:
                p.append(pin)
        for t in tier_of:
            levels[t].counters.loaded += 1
        return LoadSpec(keys, tuple(tier_of), tuple(slots), tuple(lv.medium for lv in levels))

    def _prepare_load_single(self, keys: tuple[bytes, ...]) -> LoadSpec:
        """prepare_load with one tier: the tier's pin counts are the whole story."""
        lv = self._levels[0]
        ready = self._ready
        for k in keys:
            if k not in ready:
                raise KeyError(
                    f"prepare_load: block {k.hex() if isinstance(k, bytes) else k!r} "
                    "is not ready in any tier"
                )
        pins = lv.pins
        get = pins.get
        for k in keys:
            pins[k] = get(k, 0) + 1
        lv.counters.loaded += len(keys)
        slots = tuple(map(lv.slots.__getitem__, keys))
        return LoadSpec(keys, (0,) * len(keys), slots, (lv.medium,))

    def complete_load(self, keys: Iterable[bytes]) -> None:
        """Unpin blocks pinned by `prepare_load`. Raises KeyError (and unpins nothing) if a key
        has no outstanding load."""
        keys = _seq(keys)
        if self._single:
            self._complete_load_single(keys)
            return
        pins = self._pins
        _check_loads(keys, pins, lambda k: len(pins.get(k, ())))  # key -> tier of each load
        levels = self._levels
        for k in keys:
            p = pins[k]
            t = p.pop(0)
            if not p:
                del pins[k]
            if isinstance(t, tuple):
                self._end_read(t)
            else:
                _unpin(levels[t].pins, k)

    def _end_read(self, where: tuple[int, int]) -> None:
        """A read of a leaving block's source slot ended; the last one returns the slot to
        its tier if it was freed meanwhile."""
        n = self._reads[where] - 1
        if n:
            self._reads[where] = n
            return
        del self._reads[where]
        if where in self._free_later:
            self._free_later.discard(where)
            self._levels[where[0]].tier.free((where[1],))

    def _free(self, level: _Level, slot: int) -> None:
        """Return a slot to its tier, once no read of a leaving block pins it."""
        if self._reads and (level.index, slot) in self._reads:
            self._free_later.add((level.index, slot))
        else:
            level.tier.free((slot,))

    def _complete_load_single(self, keys: Sequence[bytes]) -> None:
        """complete_load with one tier: check every key has enough pins, then unpin."""
        pins = self._levels[0].pins
        _check_loads(keys, pins, lambda k: pins.get(k, 0))  # key -> count of loads
        for k in keys:
            _unpin(pins, k)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark a chain used; its first keys end up most recently used in every tier."""
        keys = _seq(keys)
        for lv in self._levels:
            lv.policy.touch(keys)

    # -- store -----------------------------------------------------------------------------
    def prepare_store(self, keys: Iterable[bytes]) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not held anywhere yet, in the first tier; what it cannot
        take (a chain longer than it, or its room held by pinned blocks and stores in flight)
        goes straight into the next tiers with room (write-around, `plan.around`), the
        chain's head placed first, as lookups reach it first.

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
        seen_before = self._sight(new) if self._admit_mask and new else None
        # A suspended tier (its circuit breaker open: it hung) takes no store: its blocks would
        # hold the engine's until it came back. They go around it, or are not stored.
        off = self._breaker.mask()
        plan = None if off & 1 else self._reserve_first_tier(new, distinct)
        if plan is None and new:
            plan = self._reserve_around(new, distinct, off)
        if plan is None and seen_before is not None:  # a refusal changes nothing
            self._unsight(seen_before)
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
            self._hold(lv, take, slots)
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

    def _room(self, level: _Level, protect: Collection[bytes], want: int) -> int:
        """How many of `want` new blocks `level` can take: free slots plus evictable ones."""
        free = level.tier.free_blocks
        if want <= free:
            return want
        return min(want, free + self._evictable(level, protect, want - free))

    def _make_room(
        self, level: _Level, keys: list[bytes], protect: Collection[bytes], moves: list[BlockMove]
    ) -> list[int] | None:
        """Slots for `keys` in `level`, its policy's victims leaving (demoted further down by
        `moves`); None, changing nothing, if it cannot make the room."""
        tier = level.tier
        need = len(keys) - tier.free_blocks
        if need > 0:
            if len(keys) > tier.capacity_blocks:
                return None
            self._wake_oldest(level, need)
            victims = level.policy.evict(need, self._protected(protect, level))
            if victims is None:
                return None
            self._evict(level, victims, moves)
        slots = tier.allocate(keys)
        assert slots is not None, f"{level.medium} ran out of slots after eviction"
        return slots

    def _hold(self, level: _Level, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Record `keys` as held (not ready yet) in `slots` of `level` (multi-tier only)."""
        slots_of, present, bit = level.slots, self._present, level.bit
        for k, s in zip(keys, slots, strict=True):
            slots_of[k] = s
            present[k] = present.get(k, 0) | bit

    def prepare_promote(self, keys: Iterable[bytes]) -> PrepareStoreOutput | None:
        """Plan copies of keys ready only in lower tiers into the first tier.

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
            len(new) > tier.capacity_blocks or self._evictable(first, protect, need) < need
        ):
            return None
        if new:  # before evict: ARC adapts p for ghost hits first, as the paper orders it
            first.policy.on_miss(new)
        victims: list[bytes] = []
        if need > 0:
            self._wake_oldest(first, need)
            got = first.policy.evict(need, self._protected(protect, first))
            if got is None:  # a policy that refuses what it holds unprotected (see _evictable)
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

    def _evictable(self, level: _Level, protect: Collection[bytes], need: int) -> int:
        """How many of `level`'s ready blocks its policy may evict (not pinned, not in
        `protect`), or any number >= `need` when that is plain without counting."""
        pins = level.pins
        resident = len(level.policy) + level.tier.dormant_blocks
        if resident - len(pins) - len(protect) >= need:  # `protect` may hold absent keys
            return resident
        ready, bit = self._ready, level.bit
        kept = sum(1 for k in protect if ready.get(k, 0) & bit and k not in pins)
        return resident - len(pins) - kept

    def _protected(self, keys: Collection[bytes], level: _Level) -> Container[bytes]:
        """What `level`'s policy may not evict: `keys`, and its pinned blocks, as one set
        (its membership test runs in C; loads are short, so few keys are pinned at once)."""
        if not level.pins:
            return keys if isinstance(keys, set | frozenset) else set(keys)
        return level.pins.keys() | keys

    def _evict(self, level: _Level, victims: list[bytes], moves: list[BlockMove]) -> None:
        """Remove `victims` (already taken out of the policy) from `level`, demoting those no
        lower tier holds into the next tier. Deeper moves are appended before this level's
        move, because the slots they free may be the ones this level's move writes into."""
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
        if below:
            self._refresh_below(level, below)
        nxt = self._levels[level.index + 1] if level.index + 1 < len(self._levels) else None
        if nxt is not None and nxt.bit & self._breaker.mask():
            nxt = None  # suspended (it hung): a demotion would wait on it; the victims go
        if demote and nxt is not None and nxt.bit & self._admit_mask:
            keep = set(self._admitted(nxt, demote))
            if len(keep) < len(demote):
                level.counters.dropped += len(demote) - len(keep)
                pairs = [(k, s) for k, s in zip(demote, demote_slots, strict=True) if k in keep]
                demote, demote_slots = [k for k, _ in pairs], [s for _, s in pairs]
        if demote and (
            nxt is None or not self._demote_into(nxt, level, demote, demote_slots, moves)
        ):
            level.counters.dropped += len(demote)
        # Slots go back only after the move is planned: the move reads them first.
        level.tier.free(freed)

    def _refresh_below(self, level: _Level, keys: list[bytes]) -> None:
        """`keys` left `level` while a lower tier holds a cold write-through copy of them: in
        that tier the copy becomes as recent as a demotion would have made it (it was kept
        only while room allowed; now it is the block's only copy)."""
        ready = self._ready
        for lv in self._levels[level.index + 1 :]:
            if not keys:
                return
            if not lv.cold:
                continue
            here = [k for k in keys if k in lv.cold and ready.get(k, 0) & lv.bit]
            if here:
                policy = lv.policy
                for k in here:
                    policy.remove(k)
                policy.insert_many(here[::-1])  # the chain's head ends most recent
                lv.cold.difference_update(here)
                done = set(here)
                keys = [k for k in keys if k not in done]

    def _demote_into(
        self,
        dst: _Level,
        src: _Level,
        keys: list[bytes],
        src_slots: list[int],
        moves: list[BlockMove],
    ) -> bool:
        """Plan a write-back of `keys` into `dst`; False (nothing planned) if it has no room."""
        slots = self._make_room(dst, keys, frozenset(), moves)
        if slots is None:
            return False
        self._hold(dst, keys, slots)
        self._moving.update(keys)
        if self._leave:  # readable from the source slots until the move completes
            self._leaving.update((k, (src.index, s)) for k, s in zip(keys, src_slots, strict=True))
        dst.counters.demoted_in += len(keys)
        moves.append(
            BlockMove(
                tuple(keys),
                StoreSpec(src.index, src.medium, tuple(src_slots)),
                StoreSpec(dst.index, dst.medium, tuple(slots)),
            )
        )
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
                    self._free(lv, slot)
                    if not single:
                        p = present[k] & ~bit
                        if p:
                            present[k] = p
                        else:
                            del present[k]
            if done and moving:
                moving.difference_update(done)
                if self._leaving:  # served from where it now is (or gone)
                    for k in done:
                        self._leaving.pop(k, None)
            if done and success:
                if cold:  # tail first: the chain's tail is evicted first
                    lv.policy.insert_cold(done)
                    lv.cold.update(done)
                else:
                    lv.policy.insert_many(done, new=True)  # not ready here: in no policy
                done.reverse()
                lv.counters.stored += len(done)
                self._events.append(OffloadingEvent(tuple(done), lv.medium, False))
                if self._through:
                    self._queue_through(lv.index, done)

    # -- admission on reuse ------------------------------------------------------------------
    def _sight(self, keys: Iterable[bytes]) -> dict[bytes, int]:
        """Count one sighting (a store or a load) of each key, the oldest keys forgotten;
        returns the counts as they were (for `_unsight`)."""
        seen = self._seen
        before: dict[bytes, int] = {}
        for k in keys:
            before[k] = n = seen.pop(k, 0)
            seen[k] = n + 1
        over = len(seen) - self._seen_max
        if over > 0:
            for k in list(itertools.islice(seen, over)):
                del seen[k]
        return before

    def _unsight(self, before: dict[bytes, int]) -> None:
        """Undo a `_sight` (its keys go back to their counts, or are forgotten)."""
        seen = self._seen
        for k, n in before.items():
            if n:
                seen[k] = n
            else:
                seen.pop(k, None)

    def _admitted(self, level: _Level, keys: Sequence[bytes]) -> list[bytes]:
        """The keys `level` takes: all, or with admission on reuse those sighted twice (the
        rest are counted as not admitted)."""
        if not level.bit & self._admit_mask:
            return list(keys)
        seen = self._seen
        out = [k for k in keys if seen.get(k, 0) >= 2]
        level.counters.not_admitted += len(keys) - len(out)
        return out

    # -- write-through -----------------------------------------------------------------------
    def _queue_through(self, stored_in: int, keys: Sequence[bytes]) -> None:
        """Keys just stored in tier `stored_in` wait for their copy into each write-through
        tier below it that does not hold them; past the bound they are dropped, counted."""
        present = self._present
        for t, queue in self._through.items():
            if t <= stored_in:
                continue
            bit = self._levels[t].bit
            todo = [k for k in keys if not present[k] & bit and k not in queue]
            if bit & self._admit_mask:
                todo = self._admitted(self._levels[t], todo)
            room = self._through_max - len(queue)
            if len(todo) > room:
                self._levels[t].counters.through_dropped += len(todo) - max(room, 0)
                todo = todo[: max(room, 0)]
            queue.update(dict.fromkeys(todo))

    def through_backlog(self) -> int:
        """Blocks waiting for a write-through copy, over all tiers."""
        return sum(len(q) for q in self._through.values())

    def plan_write_through(self, limit: int) -> list[BlockMove]:
        """Up to `limit` queued write-through copies, oldest first, as moves from the fastest
        tier holding each block (pinned there until the copy completes) into its
        write-through tier, which makes room through its policy (deeper demotions come first
        in the list). Run them in order and complete each with `complete_write_through`.

        The blocks those demotions move out are leaving blocks (see the module doc): the
        runner writes a copy into a slot only once `reading(tier, slots)` is False."""
        self._leave = True
        try:
            return self._plan_write_through(limit)
        finally:
            self._leave = False

    def _plan_write_through(self, limit: int) -> list[BlockMove]:
        moves: list[BlockMove] = []
        ready, present = self._ready, self._present
        off = self._breaker.mask()
        for t, queue in self._through.items():
            dst = self._levels[t]
            if off & dst.bit:  # suspended (it hung): its copies wait in the queue
                continue
            above = dst.bit - 1
            by_src: dict[int, list[bytes]] = {}
            while queue and limit > 0:
                k = next(iter(queue))
                del queue[k]
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
                self._hold(dst, keys, slots)
                for k in keys:  # the source slot stays put until the copy has read it
                    src.pins[k] = src.pins.get(k, 0) + 1
                    self._through_pins.setdefault(k, []).append((src_index, t))
                moves.append(
                    BlockMove(
                        tuple(keys),
                        StoreSpec(src_index, src.medium, tuple(src.slots[k] for k in keys)),
                        StoreSpec(t, dst.medium, tuple(slots)),
                    )
                )
        return moves

    def complete_write_through(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Finish moves of `plan_write_through` (its copies and the demotions they caused):
        the blocks become ready below, or their slots go back, and the sources are unpinned."""
        keys = _seq(keys)
        pins = self._through_pins
        copies = [k for k in keys if k in pins]
        if len(copies) < len(keys):  # demotions the copies caused: ordinary moves
            done = set(copies)
            self.complete_store([k for k in keys if k not in done], success)
        self._complete_multi(copies, success, cold=True)
        for k in keys:
            srcs = pins.get(k)
            if not srcs:
                continue  # a demotion the copy caused, not a copy
            src, dst = srcs.pop(0)
            if not srcs:
                del pins[k]
            _unpin(self._levels[src].pins, k)
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
        persistent = [lv for lv in self._levels if lv.tier.persistent and not off & lv.bit]
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
                moves.append(
                    BlockMove(
                        tuple(batch),
                        StoreSpec(src.index, src.medium, tuple(src.slots[k] for k in batch)),
                        StoreSpec(dst.index, dst.medium, tuple(slots)),
                    )
                )
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
                self._free(lv, slot)
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
        level: _Level,
        keys: list[bytes],
        slots: list[int],
        *,
        event: bool = True,
        cold: bool = False,
    ) -> None:
        """Take over blocks a persistent tier recovered on open (or a shared tier's probe
        found, or a dormant block woken), oldest first. Bulk dict updates: at open this runs
        once per held block. `event`: emit their stored event (a woken block's was emitted
        at open); `cold`: they enter the policy as its first victims."""
        if not keys:
            return
        ready, present, bit = self._ready, self._present, level.bit
        held = len(level.slots)
        level.slots.update(zip(keys, slots, strict=True))  # with one tier, `present` too
        # Every key new to this tier (and so to its policy) and none given twice: the
        # policy may skip its residency tests.
        new = len(level.slots) - held == len(keys)
        for masks in (ready,) if self._single else (ready, present):
            if not masks:
                masks.update(dict.fromkeys(keys, bit))
                continue
            for k in keys:
                masks[k] = masks.get(k, 0) | bit
        if cold:
            level.policy.insert_cold(keys)
        else:
            level.policy.insert_many(keys, new=new)
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
        """Events since the last call, oldest first."""
        for index in list(self._open_marks):
            self._send_open(self._levels[index])
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier (by medium): capacity, usage and counters."""
        out: dict[str, dict[str, int]] = {}
        remaining = self._breaker.remaining()
        for lv in self._levels:
            c = lv.counters
            out[lv.medium] = {
                "capacity_blocks": lv.tier.capacity_blocks,
                "used_blocks": lv.tier.used_blocks,
                "ready_blocks": len(lv.policy) + lv.tier.dormant_blocks,
                "dormant_blocks": lv.tier.dormant_blocks,
                "pinned_blocks": len(lv.pins),
                "hits": c.hits,
                "misses": c.misses,
                "stored": c.stored,
                "loaded": c.loaded,
                "evictions": c.evictions,
                "demoted_in": c.demoted_in,
                "dropped": c.dropped,
                "errors": c.errors,
                "discovered": c.discovered,
                "written_through": c.written_through,
                "through_dropped": c.through_dropped,
                "through_queued": len(self._through.get(lv.index, ())),
                "not_admitted": c.not_admitted,
                "suspensions": c.suspensions,
                "suspended_ms": int(remaining[lv.index] * 1000),
            }
        return out
