"""`tiercache.connectors.deadlines.Flights`: due by kind, the late scan, the bounded wait that
gives up, and the bounded shutdown, with a fake clock and a fake transfer engine (no sleeps)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import pytest

from tiercache.config import DeadlineConfig
from tiercache.connectors.deadlines import CLOSE_WAIT_S, Flights


@dataclass(frozen=True)
class Rec:
    kind: str
    tier: int = 0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeTransfers:
    """Jobs in `hung` never end; the others end at once. Records every call."""

    def __init__(self, hung: Iterable[int] = (), uncancellable: Iterable[int] = ()) -> None:
        self.hung = set(hung)
        self.uncancellable = set(uncancellable)
        self.waits: list[tuple[list[int], float | None]] = []
        self.cancelled: list[int] = []
        self.closed: list[float | None] = []

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> set[int]:
        ids = list(job_ids)
        self.waits.append((ids, timeout))
        late = {j for j in ids if j in self.hung}
        if timeout is None and late:
            raise AssertionError(f"unbounded wait for hung jobs {late}")
        return late

    def cancel(self, job_id: int) -> bool:
        self.cancelled.append(job_id)
        return job_id not in self.uncancellable

    def close(self, timeout: float | None = None) -> None:
        self.closed.append(timeout)


DL = DeadlineConfig(load_timeout=5.0, store_timeout=10.0)


def make(transfers: FakeTransfers | None = None) -> tuple[Flights[Rec], Clock, FakeTransfers]:
    clock = Clock()
    t = transfers or FakeTransfers()
    return Flights(t, DL, clock=clock), clock, t


def test_due_by_kind() -> None:
    f, _, _ = make()
    assert f.add(1, Rec("load")) == 105.0
    assert f.add(2, Rec("store")) == 110.0
    assert f.add(3, Rec("move")) == 110.0
    assert (f.timeout("load"), f.timeout("store"), f.timeout("move")) == (5.0, 10.0, 10.0)
    assert f.due(1) == 105.0 and len(f) == 3 and list(f) == [1, 2, 3]
    assert 2 in f and 4 not in f and f[3] == Rec("move") and f.get(4) is None
    with pytest.raises(ValueError, match="still in flight"):
        f.add(1, Rec("load"))


def test_late_scan_once_each_in_submission_order() -> None:
    f, clock, _ = make()
    f.add(7, Rec("store"))
    f.add(3, Rec("load"))
    f.add(5, Rec("load"))
    assert f.late() == []
    clock.t = 104.9
    assert f.late() == []
    clock.t = 105.0  # due is inclusive
    assert f.late() == [3, 5]
    assert f.late(now=200.0) == [7, 3, 5]
    assert f.late(now=200.0, where=lambda r: r.kind != "load") == [7]
    f.mark_late(3)
    assert f.is_late(3) and not f.is_late(5)
    assert f.late() == [5]
    f.mark_late(42)  # not in flight: nothing to mark
    assert not f.is_late(42)


def test_pop_says_whether_it_was_late() -> None:
    f, _, _ = make()
    f.add(1, Rec("load", tier=2))
    f.add(2, Rec("store"))
    f.mark_late(1)
    assert f.pop(1) == (Rec("load", tier=2), True)
    assert f.pop(2) == (Rec("store"), False)
    assert len(f) == 0 and not f.is_late(1)
    f.add(1, Rec("load"))  # an id may come back: nothing of the old job is left
    assert not f.is_late(1)


def test_until_due() -> None:
    f, clock, _ = make()
    f.add(1, Rec("load"))
    f.add(2, Rec("store"))
    assert f.until_due([1]) == 5.0
    assert f.until_due([1, 2, 99]) == 10.0
    assert f.until_due([99]) == 0.0
    clock.t = 120.0
    assert f.until_due([1, 2]) == 0.0


def test_wait_or_give_up_nothing_late() -> None:
    f, _, t = make()
    f.add(1, Rec("load"))
    given: list[set[int]] = []
    assert f.wait_or_give_up([1], 5.0, given.append) == set()
    assert given == [] and t.waits == [([1], 5.0)]


def test_wait_or_give_up_gives_up_then_waits_for_what_it_keeps() -> None:
    t = FakeTransfers(hung={1, 2})
    f, _, _ = make(t)
    for j in (1, 2, 3):
        f.add(j, Rec("store"))
    given: list[set[int]] = []

    def give_up(late: set[int]) -> None:
        given.append(set(late))
        t.hung.clear()  # given up: they end (e.g. cancelled)

    late = f.wait_or_give_up([1, 2, 3], 10.0, give_up, still_wait=lambda j: j == 2)
    assert late == {1, 2} and given == [{1, 2}]
    assert t.waits == [([1, 2, 3], 10.0), ([2], None)]


def test_wait_or_give_up_waits_for_every_late_one_by_default() -> None:
    t = FakeTransfers(hung={1})
    f, _, _ = make(t)
    f.add(1, Rec("load"))
    f.wait_or_give_up([1], 5.0, lambda late: t.hung.clear())
    assert t.waits == [([1], 5.0), ([1], None)]


def test_shutdown_leaves_hung_transfers_behind(caplog: pytest.LogCaptureFixture) -> None:
    t = FakeTransfers(hung={2, 3}, uncancellable={3})
    f, _, _ = make(t)
    f.add(1, Rec("load", tier=0))
    f.add(2, Rec("store", tier=1))
    f.add(3, Rec("move", tier=2))
    left: list[tuple[int, Rec]] = []
    log = logging.getLogger("tiercache.test_deadlines")
    with caplog.at_level(logging.WARNING, logger=log.name):
        late = f.shutdown(lambda j, r: left.append((j, r)), log, noun="copies")
    assert late == {2, 3}
    assert t.waits == [([1, 2, 3], 10.0)]  # store_timeout by default
    assert sorted(t.cancelled) == [2, 3]
    assert sorted(left) == [(2, Rec("store", tier=1)), (3, Rec("move", tier=2))]
    [rec] = caplog.records
    assert rec.name == log.name
    assert rec.getMessage() == (
        "tiercache: 2 copies into or out of hung tiers still ran at shutdown; left behind "
        "(their blocks are not stored)"
    )
    f.close_transfers(late)
    assert t.closed == [CLOSE_WAIT_S]


def test_shutdown_nothing_hung(caplog: pytest.LogCaptureFixture) -> None:
    f, _, t = make()
    f.add(1, Rec("store"))
    log = logging.getLogger("tiercache.test_deadlines")
    with caplog.at_level(logging.WARNING, logger=log.name):
        late = f.shutdown(lambda j, r: pytest.fail("nothing is left behind"), log, timeout=3.0)
    assert late == set() and caplog.records == [] and t.cancelled == []
    assert t.waits == [([1], 3.0)]
    f.close_transfers(late)
    assert t.closed == [None]


def test_default_message_noun(caplog: pytest.LogCaptureFixture) -> None:
    f, _, _ = make(FakeTransfers(hung={1}))
    f.add(1, Rec("load"))
    log = logging.getLogger("tiercache.test_deadlines")
    with caplog.at_level(logging.WARNING, logger=log.name):
        f.shutdown(lambda j, r: None, log)
    assert caplog.records[0].getMessage().startswith("tiercache: 1 transfers into or out of")
