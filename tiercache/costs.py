"""Cost-aware loading (config ``[loading]``): load a hit only where that beats recomputing it.

Primitives:
- `LinearFit`: an exponentially weighted least-squares line ``seconds = fixed + per_unit * x``
  over a stream of (x, seconds) samples; `line()` is the current `Line` or None (no samples).
- `LoadCosts`: per tier (medium) a fit of a load job's seconds against its bytes
  (`observe_load`), and a fit of the engine's forward seconds against the tokens it computed
  (`observe_forward`); `absorb` takes both kinds measured in another process;
  `estimates()` -> `Estimates`; `tier_stats()` / `engine_stats()` for the stats and the
  Prometheus gauges. Thread-safe.
- `plan_load(tiers, ...)`: the pure decision -> `LoadDecision` (leading blocks to load).
- `ForwardTimer`: times the engine's forward passes (host clock; CUDA events on a GPU, read
  once done, never waited for) for `LoadCosts.observe_forward`.
- `LoadGate`: the mode and margin of a `LoadingConfig` over a `LoadCosts`; what an adapter
  asks (`decide`). Adapters count the decisions (loading_blocks, loading_declined_blocks,
  loading_cold_blocks).

Why lines, not plain averages: a load job costs a fixed part (a request's round trip, a
thread hand-off) plus a part per byte, and a step's forward a fixed part (the weights, the
sampler) plus a part per token. A short chain on a slow remote tier pays the whole fixed part
for little, a long one spreads it: the fit separates the two, a ratio of averages cannot.
Recomputing a block saves only the forward's marginal cost (`per_unit`), never its fixed part.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercache.config import LoadingConfig

# EWMA weight of a new sample: the estimates follow the last ~1/ALPHA jobs or steps.
ALPHA = 0.1
# Once a fit has CLAMP_AFTER samples, a new one counts for at most CLAMP times what the fit
# predicts (plus CLAMP_FLOOR_S): one stalled job moves an estimate by a bounded step instead of
# making "auto" decline a healthy tier (not measured again while declined); a tier that really
# slowed down is still followed, by a bounded factor per job.
CLAMP = 4.0
CLAMP_AFTER = 4
CLAMP_FLOOR_S = 0.001


@dataclass(frozen=True, slots=True)
class Line:
    """``seconds(x) = fixed + per_unit * x``."""

    fixed: float
    per_unit: float

    def seconds(self, x: float) -> float:
        return self.fixed + self.per_unit * x


class LinearFit:
    """Exponentially weighted least squares of seconds against x. Until 1/alpha samples the
    weights are equal (a plain mean), so early estimates are not biased toward zero."""

    def __init__(self, alpha: float = ALPHA) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self.samples = 0
        self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, seconds: float) -> None:
        """One sample; ignored unless x > 0 and seconds >= 0; an outlier is clamped (CLAMP)."""
        if not x > 0 or not seconds >= 0:
            return
        if self.samples >= CLAMP_AFTER:
            line = self.line()
            if line is not None:
                seconds = min(seconds, CLAMP * line.seconds(x) + CLAMP_FLOOR_S)
        self.samples += 1
        w = max(self.alpha, 1.0 / self.samples)
        self._x += w * (x - self._x)
        self._y += w * (seconds - self._y)
        self._xx += w * (x * x - self._xx)
        self._xy += w * (x * seconds - self._xy)

    def line(self) -> Line | None:
        """The fitted line, None before the first sample. With too little spread in x (every
        job the same size) or a fit that would give negative costs, the line through the
        origin (cost proportional to x) stands in."""
        if not self.samples:
            return None
        var = self._xx - self._x * self._x
        if var > 1e-9 * self._x * self._x:
            slope = (self._xy - self._x * self._y) / var
            fixed = self._y - slope * self._x
            if slope > 0 and fixed >= 0:
                return Line(fixed, slope)
        return Line(0.0, self._xy / self._xx)


@dataclass(frozen=True, slots=True)
class Estimates:
    """What a decision needs: per tier the load line (seconds against bytes), and the forward
    line (seconds against tokens); a missing entry is not measured yet."""

    load: Mapping[str, Line] = field(default_factory=dict)
    forward: Line | None = None


@dataclass(frozen=True, slots=True)
class LoadDecision:
    """`load` leading blocks of a hit of `hit`; `cold`: a tier of the loaded part or the
    forward was not measured yet, and its cost was taken as nothing (optimistic)."""

    load: int
    hit: int
    cold: bool = False
    load_s: float = 0.0  # estimated seconds to load the `load` blocks
    recompute_s: float = 0.0  # estimated forward seconds to compute them instead

    @property
    def declined(self) -> int:
        return self.hit - self.load


def plan_load(
    tiers: Sequence[str],
    *,
    block_bytes: int,
    block_tokens: int,
    estimates: Estimates,
    mode: str = "auto",
    margin: float = 1.0,
) -> LoadDecision:
    """How many leading blocks of a hit to load. `tiers`: the tier serving each block, in
    chain order. "always" loads all, "never" none; "auto" the prefix with the largest
    saving ``recompute(k) - margin * load(k)`` (the longest among equals), where load(k) sums
    each tier's line over its blocks among the first k (one job per tier, counted one after
    another: conservative where tiers load in parallel) and recompute(k) is the forward's
    marginal cost of k blocks' tokens. An unmeasured tier or forward costs nothing (cold)."""
    n = len(tiers)
    if mode == "always" or n == 0:
        return LoadDecision(n, n)
    if mode == "never":
        return LoadDecision(0, n)
    fwd = estimates.forward
    if fwd is None:
        return LoadDecision(n, n, cold=True)
    per_block = fwd.per_unit * block_tokens
    used: dict[str, int] = {}  # tier -> blocks among the first k
    load_s = 0.0
    best = (0.0, 0, 0.0, False)  # (saving, k, load seconds, cold)
    cold = False
    for k, tier in enumerate(tiers, 1):
        line = estimates.load.get(tier)
        if line is None:
            cold = True
        else:
            before = line.seconds(used[tier] * block_bytes) if tier in used else 0.0
            load_s += line.seconds((used.get(tier, 0) + 1) * block_bytes) - before
        used[tier] = used.get(tier, 0) + 1
        saving = k * per_block - margin * load_s
        if saving >= best[0]:
            best = (saving, k, load_s, cold)
    _, k, secs, was_cold = best
    return LoadDecision(k, n, cold=was_cold, load_s=secs, recompute_s=k * per_block)


class LoadCosts:
    """Moving estimates of each tier's load cost and of the engine's forward (thread-safe)."""

    def __init__(self, alpha: float = ALPHA) -> None:
        self._alpha = alpha
        self._load: dict[str, LinearFit] = {}
        self._forward = LinearFit(alpha)
        self._lock = threading.Lock()

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load job from `tier` moved `nbytes` in `seconds` (its own duration)."""
        self.absorb(loads=[(tier, nbytes, seconds)])

    def observe_forward(self, tokens: int, seconds: float) -> None:
        """The engine computed `tokens` in one forward of `seconds`."""
        self.absorb(forwards=[(tokens, seconds)])

    def absorb(
        self,
        loads: Sequence[tuple[str, int, float]] = (),
        forwards: Sequence[tuple[int, float]] = (),
    ) -> None:
        """Samples measured elsewhere (another process's worker), in their order."""
        with self._lock:
            for tier, nbytes, seconds in loads:
                self._load.setdefault(tier, LinearFit(self._alpha)).add(nbytes, seconds)
            for tokens, seconds in forwards:
                self._forward.add(tokens, seconds)

    def estimates(self) -> Estimates:
        with self._lock:
            load = {t: line for t, f in self._load.items() if (line := f.line()) is not None}
            return Estimates(load, self._forward.line())

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Per measured tier: load_latency_ms (the fixed part of a job), load_mb_per_s (the
        rate of the rest, 1e6 bytes), load_jobs (samples)."""
        with self._lock:
            return {
                tier: {
                    "load_latency_ms": round(line.fixed * 1e3, 4),
                    "load_mb_per_s": round(_rate(line) / 1e6, 3),
                    "load_jobs": fit.samples,
                }
                for tier, fit in self._load.items()
                if (line := fit.line()) is not None
            }

    def engine_stats(self) -> dict[str, float]:
        """The forward: prefill_tokens_per_s (marginal), step_overhead_ms, forward_steps;
        empty before the first step."""
        with self._lock:
            line = self._forward.line()
            if line is None:
                return {}
            return {
                "prefill_tokens_per_s": round(_rate(line), 3),
                "step_overhead_ms": round(line.fixed * 1e3, 4),
                "forward_steps": self._forward.samples,
            }


class ForwardTimer:
    """(tokens, seconds) of the engine's forward passes: `start` before one, `stop(tokens)`
    after, `take()` the finished ones. On a GPU the host returns before the kernels ran, so
    with `cuda` the two ends are CUDA events on the current stream, read once the end event
    completed (never synchronised: a step's timing arrives a step or so later)."""

    MAX_PENDING = 64  # CUDA timings not done yet; older ones are dropped beyond this

    def __init__(self, cuda: bool = False, clock: Callable[[], float] = time.perf_counter):
        self._cuda = cuda
        self._clock = clock
        self._start: Any = None
        self._pending: list[tuple[int, Any, Any]] = []  # CUDA: (tokens, start, end event)
        self._done: list[tuple[int, float]] = []

    def start(self) -> None:
        if self._cuda:
            import torch

            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = self._clock()

    def stop(self, tokens: int) -> None:
        """The forward that `start` began is over (on the host); it computed `tokens`."""
        start, self._start = self._start, None
        if start is None or tokens <= 0:
            return
        if not self._cuda:
            self._done.append((tokens, self._clock() - start))
            return
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((tokens, start, end))
        del self._pending[: -self.MAX_PENDING]

    def take(self) -> list[tuple[int, float]]:
        """The timings finished since the last call, oldest first."""
        while self._pending and self._pending[0][2].query():
            tokens, start, end = self._pending.pop(0)
            self._done.append((tokens, start.elapsed_time(end) / 1e3))
        done, self._done = self._done, []
        return done


def _rate(line: Line) -> float:
    return 1.0 / line.per_unit if line.per_unit > 0 else float("inf")


class LoadGate:
    """A `LoadingConfig` (mode, margin) applied to a `LoadCosts`: what an adapter asks."""

    def __init__(self, config: LoadingConfig, costs: LoadCosts | None = None) -> None:
        self.config = config
        self.costs = costs if costs is not None else LoadCosts()

    def decide(self, tiers: Sequence[str], *, block_bytes: int, block_tokens: int) -> LoadDecision:
        """How many leading blocks of a hit on `tiers` (per block, chain order) to load."""
        auto = self.config.mode == "auto"
        return plan_load(
            tiers,
            block_bytes=block_bytes,
            block_tokens=block_tokens,
            estimates=self.costs.estimates() if auto else Estimates(),
            mode=self.config.mode,
            margin=self.config.margin,
        )
