"""`CircuitBreaker`: which tiers are skipped for a while because they keep failing.

A tier that misses a load deadline (it hangs: a stopped Redis, a disk read that blocks) is
*opened*: for a back-off period (`tiercache.backoff.Backoff`, one per tier: from `backoff`,
doubling up to `backoff_max`, reset by a load in time) the manager's lookups do not see its
blocks, so the engine recomputes them instead of waiting again. Then the tier is tried again
by itself (half-open): its next miss opens it for the doubled period.

It knows tier indices and time, nothing of bytes, keys or policies. Not thread-safe: the
manager's callers hold its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tiercache.backoff import Backoff


class CircuitBreaker:
    """Per-tier open/closed state with exponential back-off."""

    def __init__(
        self,
        tiers: int,
        *,
        backoff: float = 1.0,
        backoff_max: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if tiers < 1:
            raise ValueError(f"tiers: expected >= 1, got {tiers}")
        if not 0 < backoff <= backoff_max:
            raise ValueError(f"backoff: expected 0 < backoff <= backoff_max, got {backoff}")
        self._clock = clock
        self._tiers = [Backoff(backoff, backoff_max, clock=clock) for _ in range(tiers)]
        self.trips = [0] * tiers  # times each tier was opened
        self._mask = 0  # bit i set: tier i is open
        self._next = float("inf")  # the earliest time an open tier closes

    def mask(self) -> int:
        """Bits of the tiers open now (bit i: tier i). Cheap when none is open."""
        if self._mask and self._clock() >= self._next:
            self._refresh()
        return self._mask

    def trip(self, tier: int) -> float:
        """Open `tier` (it missed a deadline or failed as a whole); returns the seconds it
        stays open. A trip while it is open already extends nothing (one hang, many jobs)."""
        now = self._clock()
        b = self._tiers[tier]
        if not b.ready(now):
            return b.until - now
        period = b.fail(now)
        self.trips[tier] += 1
        self._mask |= 1 << tier
        self._next = min(self._next, b.until)
        return period

    def succeeded(self, tier: int) -> None:
        """A transfer from `tier` completed in time: the next trip starts from `backoff`."""
        b = self._tiers[tier]
        if b.ready():
            b.succeed()

    def remaining(self) -> list[float]:
        """Per tier, seconds left open (0.0 when closed)."""
        now = self._clock()
        return [b.remaining(now) for b in self._tiers]

    def _refresh(self) -> None:
        now = self._clock()
        self._mask = 0
        self._next = float("inf")
        for i, b in enumerate(self._tiers):
            if not b.ready(now):
                self._mask |= 1 << i
                self._next = min(self._next, b.until)
