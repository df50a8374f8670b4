"""`Copies`: blocks copied into lower tiers while the faster ones keep them.

- write-through (`queue`, `plan_through`): a block stored into a faster tier waits in the
  `ThroughQueue` of each write-through tier below it (admission on reuse applies), and is
  copied off the caller's path, from the fastest tier holding it (pinned there until the copy
  completes) into that tier, which makes room through its policy (`Placement.make_room`);
- write-back at a graceful close (`writeback`): blocks held only in volatile tiers go into
  persistent tiers' free slots, most recently stored first.

Inputs, given once at construction: the manager's `Index` and its collaborators. The manager
completes the copies.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.manager.admission import Admission
from tiercache.manager.breaker import CircuitBreaker
from tiercache.manager.levels import Index
from tiercache.manager.placement import Placement
from tiercache.manager.through_queue import ThroughQueue
from tiercache.records import BlockMove


class Copies:
    """Write-through and write-back planning over a manager's levels (see the module doc)."""

    __slots__ = ("admission", "breaker", "levels", "placement", "present", "ready", "through")

    def __init__(
        self,
        index: Index,
        *,
        through: ThroughQueue,
        admission: Admission,
        breaker: CircuitBreaker,
        placement: Placement,
    ) -> None:
        self.levels, self.ready, self.present = index.levels, index.ready, index.present
        self.through, self.admission = through, admission
        self.breaker, self.placement = breaker, placement

    def queue(self, stored_in: int, keys: Sequence[bytes]) -> None:
        """Keys just stored in tier `stored_in` wait for their copy into each write-through
        tier below it that does not hold them; past the bound they are dropped, counted."""
        present, through = self.present, self.through
        for t in through.below(stored_in):
            lv = self.levels[t]
            queue, bit = through.queue(t), lv.bit
            todo = [k for k in keys if not present[k] & bit and k not in queue]
            if bit & self.admission.mask:
                todo = self.admission.admitted(lv, todo)
            lv.counters.through_dropped += through.offer(t, todo)

    def plan_through(self, limit: int) -> list[BlockMove]:
        """Up to `limit` queued write-through copies, oldest first (see
        `OffloadingManager.plan_write_through`)."""
        moves: list[BlockMove] = []
        ready, present = self.ready, self.present
        off, through = self.breaker.mask(), self.through
        for t in through.tiers:
            dst = self.levels[t]
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
                src = self.levels[src_index]
                slots = self.placement.make_room(dst, keys, frozenset(keys), moves)
                if slots is None:
                    dst.counters.through_dropped += len(keys)
                    continue
                dst.hold(self.present, keys, slots)
                for k in keys:  # the source slot stays put until the copy has read it
                    src.pins[k] = src.pins.get(k, 0) + 1
                through.pin(keys, src_index, t)
                moves.append(src.move_to(dst, keys, map(src.slots.__getitem__, keys), slots))
        return moves

    def writeback(self) -> list[BlockMove]:
        """Moves that copy blocks held only in volatile tiers into persistent tiers' free slots
        (see `OffloadingManager.plan_writeback`)."""
        off = self.breaker.mask()
        ok = [lv for lv in self.levels if not (off & lv.bit or lv.tier.read_only)]
        persistent = [lv for lv in ok if lv.tier.persistent]
        if not persistent:
            return []
        pmask = sum(lv.bit for lv in persistent)
        moves: list[BlockMove] = []
        taken: set[bytes] = set()
        for src in self.levels:
            if src.tier.persistent:
                continue
            ready, sbit = self.ready, src.bit
            todo = [
                k
                for k in reversed(src.slots)
                if ready.get(k, 0) & sbit and k not in taken and not self.present[k] & pmask
            ]
            for dst in persistent:
                room = dst.tier.free_blocks
                if not todo or not room:
                    continue
                batch, todo = todo[:room], todo[room:]
                taken.update(batch)
                slots = dst.tier.allocate(batch)
                assert slots is not None
                dst.hold(self.present, batch, slots)
                moves.append(src.move_to(dst, batch, map(src.slots.__getitem__, batch), slots))
        return moves
