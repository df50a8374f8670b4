"""`ThroughQueue`: the manager's write-through bookkeeping.

Per write-through tier, the keys waiting for their copy (oldest first, at most `limit` per
tier: the ones that do not fit are dropped, and the caller counts them), and for each copy
in flight the (source tier, destination tier) whose source slot it pins. It holds keys and
tier indices only; which keys are queued, and the plan that makes room for the copies, are
the manager's (`OffloadingManager.plan_write_through`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


class ThroughQueue:
    """Bounded per-tier queues of keys to copy, and the sources pinned by copies in flight."""

    __slots__ = ("_pins", "_queues", "limit", "tiers")

    def __init__(self, write_through: Sequence[bool], tiers: int, limit: int) -> None:
        """`write_through[i]`: tier i is written through (default none; never tier 0);
        `limit`: keys waiting per tier. ValueError on bad flags or limit."""
        through = list(write_through) or [False] * tiers
        if len(through) != tiers or through[0]:
            raise ValueError(
                "write_through: one flag per tier, and the first tier cannot be written through"
            )
        if limit < 1:
            raise ValueError(f"write_through_queue: expected >= 1, got {limit}")
        self._queues = {i: dict[bytes, None]() for i in range(tiers) if through[i]}
        self.tiers = tuple(self._queues)  # the write-through tiers, fastest first
        self.limit = limit
        self._pins: dict[bytes, list[tuple[int, int]]] = {}  # key -> (src, dst) of each copy

    def below(self, tier: int) -> list[int]:
        """The write-through tiers slower than `tier`."""
        return [t for t in self.tiers if t > tier]

    def queue(self, tier: int) -> Mapping[bytes, None]:
        """The keys waiting for a copy into `tier`, oldest first (read only)."""
        return self._queues[tier]

    def queued(self, tier: int) -> int:
        """How many keys wait for a copy into `tier` (0 for a tier not written through)."""
        q = self._queues.get(tier)
        return len(q) if q is not None else 0

    def offer(self, tier: int, keys: Sequence[bytes]) -> int:
        """Queue `keys` (none queued for `tier` yet) as far as the bound allows; returns how
        many did not fit (dropped)."""
        queue = self._queues[tier]
        room = max(self.limit - len(queue), 0)
        dropped = len(keys) - room if len(keys) > room else 0
        queue.update(dict.fromkeys(keys[:room] if dropped else keys))
        return dropped

    def pop(self, tier: int) -> bytes | None:
        """Take the oldest key waiting for `tier` off its queue (None: none waits)."""
        queue = self._queues[tier]
        if not queue:
            return None
        k = next(iter(queue))
        del queue[k]
        return k

    def pin(self, keys: Iterable[bytes], src: int, dst: int) -> None:
        """A copy of each of `keys` from tier `src` into `dst` is planned (its source pinned)."""
        pins = self._pins
        for k in keys:
            pins.setdefault(k, []).append((src, dst))

    def copying(self, key: bytes) -> bool:
        """Whether a planned copy of `key` has not completed."""
        return key in self._pins

    def unpin(self, key: bytes) -> tuple[int, int] | None:
        """The oldest copy of `key` completed: its (src, dst); None when `key` has none."""
        srcs = self._pins.get(key)
        if not srcs:
            return None
        got = srcs.pop(0)
        if not srcs:
            del self._pins[key]
        return got
