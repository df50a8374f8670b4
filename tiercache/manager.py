"""`OffloadingManager`: the bookkeeping brain over an ordered list of tiers (fastest first).

It holds keys, slots, states and reference counts, never bytes. Primitives (vLLM's
OffloadingManager shape, on 16-byte prefix keys):
- `lookup(keys) -> int | None`: leading blocks ready in any tier (None: a block of the chain is
  moving between tiers right now; ask again later);
- `prepare_load(keys) -> LoadSpec` / `complete_load(keys)`: pin blocks while they are read;
- `touch(keys)`: mark a chain used, head most recently;
- `prepare_store(keys) -> PrepareStoreOutput | None` / `complete_store(keys, success)`:
  two-phase store into the first tier, with eviction and write-back demotion plans;
- `prepare_promote(keys)`: plan copies of lower-tier hits into the first tier;
- `discard(keys)`: drop blocks found corrupt; `take_events()`; `stats()`.

Invariants: a block being stored is invisible to lookup until complete_store(success=True);
a pinned block is never evicted; a key already held is not stored again; a prepare that
returns None or raises changes no state.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable, Sequence
from dataclasses import dataclass

from tiercache.policies import EvictionPolicy
from tiercache.records import (
    BlockMove,
    LoadSpec,
    OffloadingEvent,
    PrepareStoreOutput,
    StoreSpec,
)
from tiercache.tiers import Tier


class _Rec:
    """One key's block in one tier."""

    __slots__ = ("pins", "ready", "slot")

    def __init__(self, slot: int, ready: bool = False) -> None:
        self.slot = slot
        self.ready = ready
        self.pins = 0


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


class _Level:
    """A tier with its policy, its key index and its counters."""

    __slots__ = ("bit", "blocks", "counters", "index", "medium", "policy", "tier")

    def __init__(self, index: int, tier: Tier, policy: EvictionPolicy) -> None:
        self.index = index
        self.bit = 1 << index
        self.tier = tier
        self.policy = policy
        self.medium = tier.medium
        self.blocks: dict[bytes, _Rec] = {}
        self.counters = TierCounters()


class _Protected:
    """Keys a policy must not evict: the call's own keys, and pinned blocks of this tier."""

    __slots__ = ("blocks", "keys")

    def __init__(self, keys: Iterable[bytes], blocks: dict[bytes, _Rec]) -> None:
        self.keys = keys if isinstance(keys, set | frozenset) else set(keys)
        self.blocks = blocks

    def __contains__(self, key: object) -> bool:
        if key in self.keys:
            return True
        rec = self.blocks.get(key)  # type: ignore[arg-type]
        return rec is not None and rec.pins > 0


def _seq(keys: Iterable[bytes]) -> Sequence[bytes]:
    return keys if isinstance(keys, list | tuple) else list(keys)


class OffloadingManager:
    """Multi-tier bookkeeping: where each key lives, what may be evicted, what to move."""

    def __init__(
        self, tiers: Sequence[Tier], policies: Sequence[EvictionPolicy], *, promote: bool = True
    ) -> None:
        if not tiers:
            raise ValueError("tiers: at least one tier is required")
        if len(tiers) != len(policies):
            raise ValueError(f"policies: expected one per tier ({len(tiers)}), got {len(policies)}")
        pairs = enumerate(zip(tiers, policies, strict=True))
        self._levels = [_Level(i, t, p) for i, (t, p) in pairs]
        self._promote = promote
        self._ready: dict[bytes, int] = {}  # key -> bitmask of tiers where it is ready
        self._present: dict[bytes, int] = {}  # key -> bitmask of tiers holding a record
        self._moving: set[bytes] = set()  # keys being demoted (in no tier's lookup meanwhile)
        self._pins: dict[bytes, list[int]] = {}  # key -> tier of each outstanding load (multi)
        self._loads_out = 0  # outstanding pins in all tiers (one tier: counted on records only)
        self._events: list[OffloadingEvent] = []
        self._single = len(self._levels) == 1
        # Tiers other processes write into: a lookup miss asks them (see _discover).
        self._shared = [lv for lv in self._levels if lv.tier.shared]
        for level in self._levels:
            self._adopt(level, level.tier.recover())

    # -- introspection ---------------------------------------------------------------------
    @property
    def tiers(self) -> list[Tier]:
        return [lv.tier for lv in self._levels]

    @property
    def policies(self) -> list[EvictionPolicy]:
        return [lv.policy for lv in self._levels]

    def where(self, key: bytes) -> list[int]:
        """Tiers (indices) where `key` is ready, fastest first."""
        mask = self._ready.get(key, 0)
        return [lv.index for lv in self._levels if mask & lv.bit]

    def is_pending(self, key: bytes) -> bool:
        """Whether `key` is held but not ready anywhere: its store (or a move) is in flight,
        so it will be readable once that completes (vLLM's HIT_PENDING), unless it fails."""
        return key not in self._ready and (key in self._present or key in self._moving)

    def count_ready(self, keys: Iterable[bytes]) -> int:
        """How many of `keys` are ready in some tier (no stats, no ordering)."""
        ready = self._ready
        return sum(1 for k in keys if k in ready)

    # -- lookup and load -------------------------------------------------------------------
    def lookup(self, keys: Iterable[bytes]) -> int | None:
        """Number of leading keys ready in any tier; None when the chain continues with a block
        that is moving between tiers (it will be ready again shortly). On a miss, shared tiers
        are asked for blocks another process stored since they opened (see `_discover`)."""
        keys = _seq(keys)
        get = self._ready.get
        n = 0
        for k in keys:
            if not get(k):
                break
            n += 1
        missed = len(keys) - n
        if missed and self._shared and keys[n] not in self._moving:
            got = self._discover(keys, n)
            if got:
                n += got
                while n < len(keys) and get(keys[n]):
                    n += 1
                missed = len(keys) - n
        if self._single:
            c = self._levels[0].counters
            c.hits += n
            c.misses += missed
        else:
            self._count_lookup(keys, n, missed)
        if missed and keys[n] in self._moving:
            return None
        return n

    def _discover(self, keys: Sequence[bytes], n: int) -> int:
        """`lookup` missed at keys[n]: ask the shared tiers, fastest first, for blocks another
        process stored there after they opened, and adopt the leading run one of them holds.
        Room comes from free slots; in the last tier also from eviction (its victims just
        go, as when it stores). Returns how many keys became ready."""
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
            tier = lv.tier
            found = tier.probe(tail)
            if not found:
                continue
            short = found - tier.free_blocks
            if short > 0 and lv is last:
                victims = lv.policy.evict(short, self._protected(keys, lv))
                if victims:
                    self._evict(lv, victims, [])
            take = tail[: min(found, tier.free_blocks)]
            slots = tier.adopt(take) if take else None
            if not slots:
                continue
            # Tail first into the policy, so the chain's head ends up most recently used.
            self._adopt(lv, reversed(list(zip(take, slots, strict=True))))
            lv.counters.discovered += len(take)
            return len(take)
        return 0

    def _count_lookup(self, keys: Sequence[bytes], n: int, missed: int) -> None:
        ready = self._ready
        per_tier = [0] * len(self._levels)
        for k in keys[:n]:
            m = ready[k]
            per_tier[(m & -m).bit_length() - 1] += 1
        served_below = n
        for lv, hits in zip(self._levels, per_tier, strict=True):
            served_below -= hits
            lv.counters.hits += hits
            lv.counters.misses += missed + served_below

    def prepare_load(self, keys: Iterable[bytes]) -> LoadSpec:
        """Pin each key in the fastest tier where it is ready and say where it lives.

        Raises KeyError (and pins nothing) if a key is not ready in any tier.
        """
        keys = tuple(keys)
        if self._single:
            return self._prepare_load_single(keys)
        get = self._ready.get
        tier_of: list[int] = []
        for k in keys:
            m = get(k)
            if not m:
                raise KeyError(
                    f"prepare_load: block {k.hex() if isinstance(k, bytes) else k!r} "
                    "is not ready in any tier"
                )
            tier_of.append((m & -m).bit_length() - 1)
        levels = self._levels
        pins = self._pins
        slots: list[int] = []
        for k, t in zip(keys, tier_of, strict=True):
            rec = levels[t].blocks[k]
            rec.pins += 1
            slots.append(rec.slot)
            p = pins.get(k)
            if p is None:
                pins[k] = [t]
            else:
                p.append(t)
        self._loads_out += len(keys)
        for t in tier_of:
            levels[t].counters.loaded += 1
        return LoadSpec(keys, tuple(tier_of), tuple(slots), tuple(lv.medium for lv in levels))

    def _prepare_load_single(self, keys: tuple[bytes, ...]) -> LoadSpec:
        """prepare_load with one tier: the pin count on each record is the whole story."""
        lv = self._levels[0]
        get = lv.blocks.get
        recs = [get(k) for k in keys]
        for k, rec in zip(keys, recs, strict=True):
            if rec is None or not rec.ready:
                raise KeyError(
                    f"prepare_load: block {k.hex() if isinstance(k, bytes) else k!r} "
                    "is not ready in any tier"
                )
        for rec in recs:
            rec.pins += 1
        self._loads_out += len(keys)
        lv.counters.loaded += len(keys)
        return LoadSpec(keys, (0,) * len(keys), tuple([r.slot for r in recs]), (lv.medium,))

    def complete_load(self, keys: Iterable[bytes]) -> None:
        """Unpin blocks pinned by `prepare_load`. Raises KeyError (and unpins nothing) if a key
        has no outstanding load."""
        keys = _seq(keys)
        if self._single:
            self._complete_load_single(keys)
            return
        pins = self._pins
        if len(set(keys)) == len(keys):  # distinct keys: one outstanding load each suffices
            for k in keys:
                if k not in pins:
                    raise KeyError(
                        f"complete_load: block {k.hex() if isinstance(k, bytes) else k!r} "
                        "has no outstanding load"
                    )
        else:
            need: dict[bytes, int] = {}
            for k in keys:
                need[k] = need.get(k, 0) + 1
                if len(pins.get(k, ())) < need[k]:
                    raise KeyError(
                        f"complete_load: block {k.hex() if isinstance(k, bytes) else k!r} "
                        "has no outstanding load"
                    )
        levels = self._levels
        for k in keys:
            p = pins[k]
            t = p.pop(0)
            if not p:
                del pins[k]
            levels[t].blocks[k].pins -= 1
        self._loads_out -= len(keys)

    def _complete_load_single(self, keys: Sequence[bytes]) -> None:
        """complete_load with one tier: check every record has enough pins, then unpin."""
        get = self._levels[0].blocks.get
        recs = [get(k) for k in keys]
        distinct = len(set(keys)) == len(keys)
        need: dict[bytes, int] = {}
        for k, rec in zip(keys, recs, strict=True):
            n = 1 if distinct else need.get(k, 0) + 1
            if not distinct:
                need[k] = n
            if rec is None or rec.pins < n:
                raise KeyError(
                    f"complete_load: block {k.hex() if isinstance(k, bytes) else k!r} "
                    "has no outstanding load"
                )
        for rec in recs:
            rec.pins -= 1
        self._loads_out -= len(keys)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark a chain used; its first keys end up most recently used in every tier."""
        keys = _seq(keys)
        for lv in self._levels:
            lv.policy.touch(keys)

    # -- store -----------------------------------------------------------------------------
    def prepare_store(self, keys: Iterable[bytes]) -> PrepareStoreOutput | None:
        """Reserve first-tier slots for the keys not held anywhere yet.

        Returns None (changing nothing) when the first tier cannot make room because too many
        of its blocks are pinned. Raises ValueError on duplicate keys.
        """
        keys = _seq(keys)
        present = self._present
        new = [k for k in keys if k not in present]
        distinct = set(keys)
        if len(distinct) != len(keys):
            raise ValueError("prepare_store: keys contain duplicates")
        return self._reserve_first_tier(new, distinct)

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
        if new:  # before evict: ARC adapts p for ghost hits first, as the paper orders it
            first.policy.on_miss(new)
        tier = first.tier
        need = len(new) - tier.free_blocks
        victims: list[bytes] = []
        if need > 0:
            if len(new) > tier.capacity_blocks:
                return None
            got = first.policy.evict(need, self._protected(protect, first))
            if got is None:
                return None
            victims = got
        # From here on nothing fails: every state change below is committed together.
        moves: list[BlockMove] = []
        if victims:
            self._evict(first, victims, moves)
        slots = tier.allocate(new)
        assert slots is not None, "first tier ran out of slots after eviction"
        first.blocks.update(zip(new, map(_Rec, slots), strict=True))
        present = self._present
        bit = first.bit
        if self._single:  # every new key is absent from `present` (one tier, none held)
            present.update(dict.fromkeys(new, bit))
        else:
            for k in new:
                present[k] = present.get(k, 0) | bit
        return PrepareStoreOutput(
            keys_to_store=tuple(new),
            store_spec=StoreSpec(0, first.medium, tuple(slots)),
            evicted_keys=tuple(victims),
            moves=tuple(moves),
        )

    def _protected(self, keys: Collection[bytes], level: _Level) -> Container[bytes]:
        """What `level`'s policy may not evict: `keys`, and its pinned blocks. While no load
        is outstanding that is just a set, whose membership test runs in C."""
        if not self._loads_out:
            return keys if isinstance(keys, set | frozenset) else set(keys)
        return _Protected(keys, level.blocks)

    def _evict(self, level: _Level, victims: list[bytes], moves: list[BlockMove]) -> None:
        """Remove `victims` (already taken out of the policy) from `level`, demoting those no
        lower tier holds into the next tier. Deeper moves are appended before this level's
        move, because the slots they free may be the ones this level's move writes into."""
        blocks = level.blocks
        ready, present = self._ready, self._present
        if self._single:  # each victim is ready here and nowhere else: it just goes
            pop = blocks.pop
            freed_slots = [pop(k).slot for k in victims]
            for k in victims:
                del ready[k]
                del present[k]
            level.counters.evictions += len(victims)
            level.counters.dropped += len(victims)
            self._events.append(OffloadingEvent(tuple(victims), level.medium, True))
            level.tier.free(freed_slots)
            return
        bit, lower_mask = level.bit, ~((level.bit << 1) - 1)
        freed: list[int] = []
        demote: list[bytes] = []
        demote_slots: list[int] = []
        for k in victims:
            rec = blocks.pop(k)
            freed.append(rec.slot)
            m = ready[k] & ~bit
            if m:
                ready[k] = m
            else:
                del ready[k]
            p = present[k] & ~bit
            if p & lower_mask:
                present[k] = p
                continue
            if p:
                present[k] = p
            else:
                del present[k]
            demote.append(k)
            demote_slots.append(rec.slot)
        level.counters.evictions += len(victims)
        self._events.append(OffloadingEvent(tuple(victims), level.medium, True))
        if demote:
            nxt = self._levels[level.index + 1] if level.index + 1 < len(self._levels) else None
            if nxt is None or not self._demote_into(nxt, level, demote, demote_slots, moves):
                level.counters.dropped += len(demote)
        # Slots go back only after the move is planned: the move reads them first.
        level.tier.free(freed)

    def _demote_into(
        self,
        dst: _Level,
        src: _Level,
        keys: list[bytes],
        src_slots: list[int],
        moves: list[BlockMove],
    ) -> bool:
        """Plan a write-back of `keys` into `dst`; False (nothing planned) if it has no room."""
        tier = dst.tier
        need = len(keys) - tier.free_blocks
        if need > 0:
            if len(keys) > tier.capacity_blocks:
                return False
            victims = dst.policy.evict(need, self._protected(frozenset(), dst))
            if victims is None:
                return False
            self._evict(dst, victims, moves)
        slots = tier.allocate(keys)
        assert slots is not None, "tier ran out of slots after eviction"
        blocks, present, bit = dst.blocks, self._present, dst.bit
        for k, s in zip(keys, slots, strict=True):
            blocks[k] = _Rec(s, False)
            present[k] = present.get(k, 0) | bit
            self._moving.add(k)
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
        ready, present = self._ready, self._present
        moving = self._moving
        for lv in self._levels:
            blocks, bit = lv.blocks, lv.bit
            get = blocks.get
            done: list[bytes] = []
            # Reverse order: the policy then holds a chain's head as the most recent insert.
            for k in reversed(keys):
                rec = get(k)
                if rec is None or rec.ready:
                    continue
                done.append(k)
                if success:
                    rec.ready = True
                    ready[k] = ready.get(k, 0) | bit
                else:
                    del blocks[k]
                    lv.tier.free((rec.slot,))
                    p = present[k] & ~bit
                    if p:
                        present[k] = p
                    else:
                        del present[k]
            if done and moving:
                moving.difference_update(done)
            if done and success:
                lv.policy.insert_many(done)
                done.reverse()
                lv.counters.stored += len(done)
                self._events.append(OffloadingEvent(tuple(done), lv.medium, False))

    def _complete_store_single(self, keys: Sequence[bytes]) -> None:
        """Successful complete_store with one tier: nothing moves, and no key completed here
        was ready before, so `ready` takes them in one update."""
        lv = self._levels[0]
        get = lv.blocks.get
        done: list[bytes] = []
        for k in reversed(keys):  # reversed: the chain's head becomes the most recent insert
            rec = get(k)
            if rec is not None and not rec.ready:
                rec.ready = True
                done.append(k)
        if done:
            self._ready.update(dict.fromkeys(done, lv.bit))
            lv.policy.insert_many(done)
            done.reverse()
            lv.counters.stored += len(done)
            self._events.append(OffloadingEvent(tuple(done), lv.medium, False))

    def plan_writeback(self) -> list[BlockMove]:
        """Moves that copy blocks held only in volatile tiers into persistent tiers' free slots,
        most recently stored first, so a graceful restart keeps what fits.

        Nothing is evicted for them. Complete each move with `complete_store(move.keys)`.
        """
        persistent = [lv for lv in self._levels if lv.tier.persistent]
        if not persistent:
            return []
        pmask = sum(lv.bit for lv in persistent)
        moves: list[BlockMove] = []
        taken: set[bytes] = set()
        for src in self._levels:
            if src.tier.persistent:
                continue
            todo = [
                k
                for k, rec in reversed(src.blocks.items())
                if rec.ready and k not in taken and not self._present[k] & pmask
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
                    dst.blocks[k] = _Rec(s, False)
                    self._present[k] |= dst.bit
                moves.append(
                    BlockMove(
                        tuple(batch),
                        StoreSpec(src.index, src.medium, tuple(src.blocks[k].slot for k in batch)),
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
                rec = lv.blocks.get(k)
                if rec is not None and rec.pins:
                    raise ValueError(f"discard: block {k.hex()} is being loaded from {lv.medium}")
        dropped = 0
        ready, present = self._ready, self._present
        for lv in levels:
            gone: list[bytes] = []
            for k in keys:
                rec = lv.blocks.get(k)
                if rec is None or not rec.ready:
                    continue
                del lv.blocks[k]
                lv.policy.remove(k)
                lv.tier.free((rec.slot,))
                for d in (ready, present):
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

    def _adopt(self, level: _Level, entries: Iterable[tuple[bytes, int]]) -> None:
        """Take over blocks a persistent tier recovered on open, oldest first."""
        adopted: list[bytes] = []
        for k, slot in entries:
            level.blocks[k] = _Rec(slot, True)
            self._ready[k] = self._ready.get(k, 0) | level.bit
            self._present[k] = self._present.get(k, 0) | level.bit
            level.policy.insert(k)
            adopted.append(k)
        if adopted:
            self._events.append(OffloadingEvent(tuple(adopted), level.medium, False))

    def record_error(self, tier: int, n: int = 1) -> None:
        """Count failed transfers or verifications against a tier."""
        self._levels[tier].counters.errors += n

    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier (by medium): capacity, usage and counters."""
        out: dict[str, dict[str, int]] = {}
        for lv in self._levels:
            c = lv.counters
            out[lv.medium] = {
                "capacity_blocks": lv.tier.capacity_blocks,
                "used_blocks": lv.tier.used_blocks,
                "ready_blocks": len(lv.policy),
                "pinned_blocks": sum(1 for r in lv.blocks.values() if r.pins),
                "hits": c.hits,
                "misses": c.misses,
                "stored": c.stored,
                "loaded": c.loaded,
                "evictions": c.evictions,
                "demoted_in": c.demoted_in,
                "dropped": c.dropped,
                "errors": c.errors,
                "discovered": c.discovered,
            }
        return out
