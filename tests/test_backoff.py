"""`tiercache.backoff.Backoff` against a fake clock: the doubling, the cap, the reset, the
`until`/`ready` window and `hold`."""

from __future__ import annotations

import math

import pytest

from tiercache.backoff import Backoff


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_fresh_backoff_is_ready_and_waits_nothing() -> None:
    b = Backoff(0.1, 5.0, clock=FakeClock())
    assert b.ready() and b.remaining() == 0.0
    assert (b.period, b.until) == (0.0, 0.0)


def test_periods_double_from_start_up_to_the_maximum() -> None:
    clock = FakeClock()
    b = Backoff(1.0, 5.0, clock=clock)
    assert [b.fail() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.until == 105.0


def test_the_wait_ends_at_until() -> None:
    clock = FakeClock(10.0)
    b = Backoff(2.0, 30.0, clock=clock)
    assert b.fail() == 2.0 and b.until == 12.0
    assert not b.ready() and b.remaining() == 2.0
    clock.t = 11.5
    assert not b.ready() and b.remaining() == 0.5
    clock.t = 12.0
    assert b.ready() and b.remaining() == 0.0


def test_explicit_now_wins_over_the_clock() -> None:
    b = Backoff(1.0, 8.0, clock=FakeClock(0.0))
    assert b.fail(now=50.0) == 1.0 and b.until == 51.0
    assert not b.ready(50.5) and b.ready(51.0)
    assert b.remaining(50.25) == 0.75


def test_success_resets_the_streak_but_not_the_running_wait() -> None:
    clock = FakeClock(0.0)
    b = Backoff(1.0, 30.0, clock=clock)
    b.fail()
    b.fail()
    assert b.period == 2.0
    b.succeed()
    assert b.period == 0.0 and b.until == 2.0 and not b.ready()
    clock.t = 3.0
    assert b.fail() == 1.0 and b.until == 4.0


def test_start_is_not_capped_by_the_maximum() -> None:
    # Redis accepts a backoff_max below its 0.1 s start: the start stands, doublings are capped.
    b = Backoff(0.1, 0.05, clock=FakeClock(0.0))
    assert [b.fail() for _ in range(3)] == [0.1, 0.05, 0.05]


def test_start_equal_to_maximum_is_a_fixed_retry() -> None:
    b = Backoff(1.0, 1.0, clock=FakeClock(0.0))
    assert [b.fail() for _ in range(3)] == [1.0, 1.0, 1.0]


def test_initial_period_is_doubled_at_the_first_failure() -> None:
    b = Backoff(0.1, 5.0, period=0.1, clock=FakeClock(0.0))
    assert b.fail() == 0.2
    b.succeed()
    assert b.fail() == 0.1


def test_hold_extends_only_forward_and_keeps_the_period() -> None:
    clock = FakeClock(0.0)
    b = Backoff(1.0, 10.0, clock=clock)
    b.hold(5.0)
    assert b.until == 5.0 and b.period == 0.0 and not b.ready()
    b.hold(3.0)
    assert b.until == 5.0
    b.fail()  # a failure restarts the wait from now, whatever was held
    assert b.until == 1.0
    b.hold(math.inf)
    clock.t = 1e12
    assert not b.ready() and b.remaining() == math.inf


def test_now_reads_the_injected_clock() -> None:
    clock = FakeClock(7.0)
    assert Backoff(1.0, 2.0, clock=clock).now() == 7.0


@pytest.mark.parametrize(("start", "maximum"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_arguments_are_refused(start: float, maximum: float) -> None:
    with pytest.raises(ValueError):
        Backoff(start, maximum)
