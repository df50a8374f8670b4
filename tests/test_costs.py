"""Cost-aware loading (issue 16, item 2): the estimators and the decision, with numbers given
(no clock), the `[loading]` table, and where the estimates show (stats, Prometheus)."""

from __future__ import annotations

import pytest
import torch

from tiercache import TierCache, costs
from tiercache.config import CacheConfig, LoadingConfig
from tiercache.costs import (
    Estimates,
    ForwardTimer,
    Line,
    LinearFit,
    LoadCosts,
    LoadGate,
    plan_load,
)
from tiercache.errors import ConfigError
from tiercache.transfer.stats import PrometheusMetrics

MB = 10**6
BLOCK = MB  # bytes per block
TOKENS = 32  # tokens per block


# -- the fit ----------------------------------------------------------------------------------
def test_fit_separates_the_fixed_part_from_the_rate() -> None:
    fit = LinearFit()
    assert fit.line() is None
    # A remote tier: 20 ms per job, then 100 MB/s; jobs of 1..8 blocks.
    for n in [1, 4, 2, 8, 1, 3, 8, 2]:
        fit.add(n * BLOCK, 0.020 + n * BLOCK / (100 * MB))
    line = fit.line()
    assert line is not None
    assert line.fixed == pytest.approx(0.020)
    assert 1 / line.per_unit == pytest.approx(100 * MB)


def test_fit_with_one_size_is_proportional_and_ignores_empty_jobs() -> None:
    fit = LinearFit()
    fit.add(0, 5.0)  # an empty job says nothing about cost per byte
    fit.add(2 * BLOCK, -1.0)  # nor does a negative duration
    assert fit.line() is None and fit.samples == 0
    for _ in range(3):
        fit.add(2 * BLOCK, 0.010)
    assert fit.line() == Line(0.0, pytest.approx(0.005 / BLOCK))


def test_fit_follows_a_tier_that_slows_down() -> None:
    fit = LinearFit(alpha=0.1)
    for i in range(50):
        fit.add((1 + i % 4) * BLOCK, (1 + i % 4) * 0.001)  # 1 GB/s
    for i in range(100):  # the tier is now ten times slower
        fit.add((1 + i % 4) * BLOCK, (1 + i % 4) * 0.010)
    line = fit.line()
    assert line is not None and line.seconds(BLOCK) == pytest.approx(0.010, rel=0.01)


def test_fit_weights_are_equal_until_one_over_alpha_samples() -> None:
    fit = LinearFit(alpha=0.5)
    fit.add(BLOCK, 0.004)
    fit.add(BLOCK, 0.002)  # weight 1/2 either way
    fit.add(BLOCK, 0.000)  # now 0.5, not 1/3: newer samples count more
    line = fit.line()
    assert line is not None and line.seconds(BLOCK) == pytest.approx(0.0015)
    with pytest.raises(ValueError, match="alpha"):
        LinearFit(alpha=0)


# -- the decision -----------------------------------------------------------------------------
# The forward: 10 ms per step, then 1 ms per 32 tokens: recomputing a block saves 1 ms.
FORWARD = Line(0.010, 0.001 / TOKENS)
FAST = Line(0.0002, 0.0001 / BLOCK)  # memory: 0.2 ms per job, 0.1 ms per block
REMOTE = Line(0.020, 0.0005 / BLOCK)  # 20 ms per job, 0.5 ms per block


def _plan(tiers: list[str], mode: str = "auto", margin: float = 1.0, **load: Line) -> int:
    est = Estimates(load=load, forward=FORWARD)
    d = plan_load(
        tiers, block_bytes=BLOCK, block_tokens=TOKENS, estimates=est, mode=mode, margin=margin
    )
    assert d.hit == len(tiers) and d.declined == d.hit - d.load
    return d.load


def test_a_short_chain_on_a_slow_remote_tier_is_recomputed_a_long_one_loaded() -> None:
    # 10 blocks: 20 + 5 = 25 ms to load, 10 ms to recompute.
    assert _plan(["redis"] * 10, redis=REMOTE) == 0
    # 100 blocks: 20 + 50 = 70 ms to load, 100 ms to recompute.
    assert _plan(["redis"] * 100, redis=REMOTE) == 100
    # Break-even: 20 + 0.5 k = k at k = 40 (equal: loaded, it saves the compute).
    assert _plan(["redis"] * 40, redis=REMOTE) == 40
    assert _plan(["redis"] * 39, redis=REMOTE) == 0


def test_a_fast_prefix_is_loaded_and_a_short_slow_tail_recomputed() -> None:
    # 8 blocks from memory, then 10 from the remote tier: the tail alone is not worth it.
    assert _plan(["cpu"] * 8 + ["redis"] * 10, cpu=FAST, redis=REMOTE) == 8
    # A long tail is.
    assert _plan(["cpu"] * 8 + ["redis"] * 60, cpu=FAST, redis=REMOTE) == 68


def test_margin_modes_and_cold_start() -> None:
    # margin 2: loading must be twice as cheap; 100 blocks cost 70 ms against 100 ms.
    assert _plan(["redis"] * 100, margin=2.0, redis=REMOTE) == 0
    assert _plan(["redis"] * 10, mode="always", redis=REMOTE) == 10
    assert _plan(["cpu"] * 10, mode="never", cpu=FAST) == 0
    # An unmeasured tier costs nothing yet (optimistic), and says so.
    d = plan_load(
        ["cpu", "nvme"],
        block_bytes=BLOCK,
        block_tokens=TOKENS,
        estimates=Estimates(load={"cpu": FAST}, forward=FORWARD),
    )
    assert (d.load, d.cold) == (2, True)
    # No forward measured: everything is loaded.
    d = plan_load(
        ["redis"] * 3,
        block_bytes=BLOCK,
        block_tokens=TOKENS,
        estimates=Estimates(load={"redis": REMOTE}),
    )
    assert (d.load, d.cold) == (3, True)
    # A measured prefix loaded, with its estimates.
    d = plan_load(
        ["cpu"] * 4,
        block_bytes=BLOCK,
        block_tokens=TOKENS,
        estimates=Estimates(load={"cpu": FAST}, forward=FORWARD),
    )
    assert (d.load, d.cold) == (4, False)
    assert d.load_s == pytest.approx(0.0006) and d.recompute_s == pytest.approx(0.004)


def test_gate_applies_the_mode_to_measured_costs() -> None:
    costs = LoadCosts()
    for n in (1, 2, 4, 8):  # the remote tier and the forward, as measured
        costs.observe_load("redis", n * BLOCK, REMOTE.seconds(n * BLOCK))
        costs.observe_forward(n * 100, FORWARD.seconds(n * 100))
    auto = LoadGate(LoadingConfig(mode="auto"), costs)
    always = LoadGate(LoadingConfig(mode="always"), costs)
    assert auto.decide(["redis"] * 10, block_bytes=BLOCK, block_tokens=TOKENS).load == 0
    assert always.decide(["redis"] * 10, block_bytes=BLOCK, block_tokens=TOKENS).load == 10


def test_forward_timer_on_the_host_clock() -> None:
    clock = iter([1.0, 1.25, 2.0, 3.0, 3.5, 4.0]).__next__
    timer = ForwardTimer(clock=clock)
    timer.stop(100)  # never started: nothing
    timer.start()
    timer.stop(100)
    timer.start()
    timer.stop(0)  # no tokens (a step without a forward): nothing
    timer.start()
    timer.start()  # started again (synchronous loads ran before the forward): from here
    timer.stop(300)
    assert timer.take() == [(100, 0.25), (300, 0.5)]
    assert timer.take() == []


# -- configuration ----------------------------------------------------------------------------
def test_loading_table_is_validated() -> None:
    tiers = [{"kind": "cpu", "blocks": 4}]
    assert CacheConfig.from_mapping({"tiers": tiers}).loading == LoadingConfig("always", 1.0)
    cfg = CacheConfig.from_mapping({"tiers": tiers, "loading": {"mode": "never", "margin": 2}})
    assert cfg.loading == LoadingConfig("never", 2)
    for bad, field in [
        ({"mode": "sometimes"}, "loading.mode"),
        ({"margin": 0}, "loading.margin"),
        ({"margin": True}, "loading.margin"),
        ({"margin": "1"}, "loading.margin"),
        ({"rate": 1}, "loading.rate"),
    ]:
        with pytest.raises(ConfigError, match=field):
            CacheConfig.from_mapping({"tiers": tiers, "loading": bad})
    with pytest.raises(ConfigError, match=r"^loading"):
        CacheConfig.from_mapping({"tiers": tiers, "loading": "auto"})


# -- where the estimates show -----------------------------------------------------------------
def test_estimates_in_cache_stats_snapshot_and_prometheus() -> None:
    cfg = {"tiers": [{"kind": "cpu", "blocks": 4}], "block_size": 4}
    with TierCache.open(cfg, block_bytes=64) as cache:
        assert "load_latency_ms" not in cache.stats()["cpu"]  # nothing measured yet
        assert "engine" not in cache.snapshot()
        cache.put(cache.hash_tokens(list(range(4))), torch.zeros((1, 64), dtype=torch.uint8))
        # Samples from another process arrive through absorb; a line of 1 ms + 2 ms per MB.
        cache.load_costs.absorb(
            [("cpu", MB, 0.003), ("cpu", 3 * MB, 0.007)], [(100, 0.011), (300, 0.013)]
        )
        st = cache.stats()["cpu"]
        assert (st["load_latency_ms"], st["load_mb_per_s"], st["load_jobs"]) == (1.0, 500.0, 2)
        engine = cache.snapshot()["engine"]
        assert engine == {
            "prefill_tokens_per_s": 100_000.0,
            "step_overhead_ms": 10.0,
            "forward_steps": 2,
        }
        prom = PrometheusMetrics()
        prom.observe_tiers(cache.stats())
        prom.observe_engine(engine)
        text = prom.exposition().decode()
    assert 'tiercache_tier_load_latency_ms{tier="cpu"} 1.0' in text
    assert 'tiercache_tier_load_mb_per_s{tier="cpu"} 500.0' in text
    assert "tiercache_engine_prefill_tokens_per_s 100000.0" in text


def test_one_stalled_job_moves_the_estimate_a_bounded_step(monkeypatch) -> None:
    """A hiccup (one job 1,000 times slower) must not make "auto" decline a healthy tier: the
    sample is clamped to CLAMP x the prediction, so the next decision still loads."""

    def fit_with_a_stall() -> Line:
        fit = LinearFit(alpha=0.1)
        for i in range(20):
            fit.add((1 + i % 4) * BLOCK, 0.0002 + (1 + i % 4) * 0.0001)  # 0.3 ms a block
        before = fit.line()
        fit.add(BLOCK, 0.3)  # one read stalled for 300 ms
        after = fit.line()
        assert before is not None and after is not None
        return after

    def loads(line: Line) -> int:
        est = Estimates(load={"nvme": line}, forward=FORWARD)
        return plan_load(["nvme"] * 4, block_bytes=BLOCK, block_tokens=TOKENS, estimates=est).load

    line = fit_with_a_stall()
    assert line.seconds(BLOCK) < 0.002
    assert loads(line) == 4  # 4 blocks, ~1 ms each to recompute: still cheaper to load
    # Without the clamp, that one sample makes the tier look ~30 ms a job: all declined.
    monkeypatch.setattr(costs, "CLAMP", float("inf"))
    assert loads(fit_with_a_stall()) == 0


def test_the_first_samples_are_never_clamped() -> None:
    fit = LinearFit(alpha=0.1)
    fit.add(BLOCK, 0.001)
    fit.add(BLOCK, 1.0)  # too few samples to tell an outlier from the tier's real cost
    line = fit.line()
    assert line is not None and line.seconds(BLOCK) == pytest.approx(0.5005)
