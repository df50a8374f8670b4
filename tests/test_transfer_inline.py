"""Inline issue (`LaneHandler.issues_inline`, the CUDA handler's): a job runs on the caller's
thread only when its lane is idle and every job it follows is issued; otherwise it queues,
and a lane's jobs still run and finish in submission order."""

from __future__ import annotations

import threading
import time

from tests.test_transfer_common import K
from tiercache.transfer import GPULoadStoreSpec, Job, LaneHandler, TierLoadStoreSpec


class Recorder(LaneHandler):
    """Records (job id, thread name) as jobs run."""

    issues_inline = True

    def __init__(self) -> None:
        self.ran: list[tuple[int, str]] = []
        super().__init__({"store": 1}, name="rec")

    def lane_of(self, job: Job) -> str:
        return "store"

    def run(self, job: Job, lane: str) -> None:
        self.ran.append((job.job_id, threading.current_thread().name))


def job(i: int) -> Job:
    return Job(i, GPULoadStoreSpec([i]), TierLoadStoreSpec(0, "cpu", [i], [K(i)]))


def until(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_an_idle_lane_runs_a_job_on_the_callers_thread() -> None:
    h = Recorder()
    try:
        h.transfer_async(job(0))
        assert h.ran == [(0, threading.current_thread().name)]
        assert [j.job_id for j in h.get_finished()] == [0]
    finally:
        h.close()


def test_a_busy_lane_or_an_unissued_dependency_queues_the_job_in_order() -> None:
    h = Recorder()
    me = threading.current_thread().name
    try:
        blocker = job(9)  # never submitted: a dependency that is not issued yet
        j1 = job(1)
        j1.deps = [(blocker, True)]
        h.transfer_async(j1)  # its dependency is not issued: queued, waits on the lane thread
        h.transfer_async(job(2))  # the lane is busy with j1: queued behind it, not inline
        assert h.ran == []
        blocker.read_done.set()
        blocker.issued.set()
        until(lambda: len(h.ran) == 2)
        assert [i for i, _ in h.ran] == [1, 2]
        assert all(name != me for _, name in h.ran)
        done: list[int] = []
        until(lambda: done.extend(j.job_id for j in h.get_finished()) or len(done) == 2)
        assert done == [1, 2]
        h.transfer_async(job(3))  # the lane is idle again: inline
        assert h.ran[-1] == (3, me)
    finally:
        h.close()
