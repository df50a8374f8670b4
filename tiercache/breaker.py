"""`CircuitBreaker`: which tiers are skipped for a while because they keep failing.

A tier that misses a load deadline (it hangs: a stopped Redis, a disk read that blocks) is
*opened*: for a back-off period the manager's lookups do not see its blocks, so the engine
recomputes them instead of waiting again. The period starts at `backoff` seconds and doubles
with every trip that follows without a success in between, up to `backoff_max`; a load that
completes in time from the tier resets it. When the period ends the tier is tried again by
itself (half-open): its next miss opens it for the doubled period.

It knows tier indices and time, nothing of bytes, keys or policies. Not thread-safe: the
manager's callers hold its lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable


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
        self._backoff = float(backoff)
        self._max = float(backoff_max)
        self._clock = clock
        self._until = [0.0] * tiers  # monotonic time the tier closes again
        self._period = [0.0] * tiers  # the last period it was opened for (0: healthy)
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
        if self._until[tier] > now:
            return self._until[tier] - now
        period = min(self._max, self._period[tier] * 2) if self._period[tier] else self._backoff
        self._period[tier] = period
        self._until[tier] = now + period
        self.trips[tier] += 1
        self._mask |= 1 << tier
        self._next = min(self._next, self._until[tier])
        return period

    def succeeded(self, tier: int) -> None:
        """A transfer from `tier` completed in time: the next trip starts from `backoff`."""
        if self._until[tier] <= self._clock():
            self._period[tier] = 0.0

    def remaining(self) -> list[float]:
        """Per tier, seconds left open (0.0 when closed)."""
        now = self._clock()
        return [max(0.0, u - now) for u in self._until]

    def _refresh(self) -> None:
        now = self._clock()
        self._mask = 0
        self._next = float("inf")
        for i, u in enumerate(self._until):
            if u > now:
                self._mask |= 1 << i
                self._next = min(self._next, u)
