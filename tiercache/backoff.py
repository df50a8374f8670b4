"""`Backoff`: the one rule for "wait before trying this again".

Four places skip something that keeps failing for a while: the manager's circuit breaker (per
tier), the Redis tier's availability window, the LMDB probe's reopen retry and the vLLM
connector's per-medium suspensions. They share this object: `fail` starts a wait of `start`
seconds after a success, else double the last one, up to `maximum` (`start` itself is not
capped); `succeed` forgets the streak without ending a wait; `ready`, `remaining`; `hold`
waits at least until a given time (`math.inf`: never again).

`period` is the length of the last wait (0.0: none since the last success); `until` the clock
time the current wait ends (0.0 at first: ready). Every method that reads the time takes an
optional `now`, else asks the injected clock (`time.monotonic` by default). Not thread-safe:
callers hold their lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Backoff:
    """A doubling wait from `start` up to `maximum`, reset by a success."""

    __slots__ = ("_clock", "maximum", "period", "start", "until")

    def __init__(
        self,
        start: float,
        maximum: float,
        *,
        period: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`period`: the wait to double at the first `fail` (0.0: that one waits `start`)."""
        if not start > 0:
            raise ValueError(f"start: expected > 0, got {start}")
        if not maximum > 0:
            raise ValueError(f"maximum: expected > 0, got {maximum}")
        self.start = float(start)
        self.maximum = float(maximum)
        self.period = float(period)
        self.until = 0.0
        self._clock = clock

    def now(self) -> float:
        """The injected clock's time."""
        return self._clock()

    def ready(self, now: float | None = None) -> bool:
        """The current wait (if any) is over."""
        return (self._clock() if now is None else now) >= self.until

    def remaining(self, now: float | None = None) -> float:
        """Seconds left of the current wait (0.0 when ready)."""
        return max(0.0, self.until - (self._clock() if now is None else now))

    def fail(self, now: float | None = None) -> float:
        """Start the next wait from `now`: `start` after a success, else the last period
        doubled (at most `maximum`). Returns its length."""
        if now is None:
            now = self._clock()
        self.period = min(self.maximum, self.period * 2) if self.period else self.start
        self.until = now + self.period
        return self.period

    def succeed(self) -> None:
        """The next `fail` waits `start` again; a wait running now is not ended."""
        self.period = 0.0

    def hold(self, until: float) -> None:
        """Wait at least until `until` (clock time); the period is not changed."""
        self.until = max(self.until, until)

    def __repr__(self) -> str:
        return (
            f"Backoff(start={self.start}, maximum={self.maximum}, "
            f"period={self.period}, until={self.until})"
        )
