"""Handlers: what the worker dispatches jobs to, one per (source medium, destination medium).

Primitives:
- `TransferHandler` (ABC): `check(job)`, `transfer_async(job)`, `get_finished()`, `close()`.
- `LaneHandler`: the shared machinery of the copy handlers. Jobs go to a named lane (e.g. one
  per direction, or per tier, so a hung tier stalls only its own lane); each lane is a FIFO
  served by its own thread(s), which wait for a job's dependencies, run it, and mark it
  issued. Subclasses say which lane a job takes (`lane_of`), check it on the caller's thread
  (`check`, `prepare`) and do the work (`run`). An expedited job (`Job.expedited`: a load the
  engine waits for within its step) runs on an expedited lane (`expedited_lane_of`), started
  on first use, so it never queues behind regular jobs, only behind the jobs it depends on.
- Inline issue (`issues_inline`): a handler whose `run` only queues asynchronous work (CUDA
  copies on a stream) runs a job on the caller's thread when its lane is idle and every job
  it follows is issued, saving two thread hand-offs; the lane's order is kept.
- `tier_of(tiers, spec)` and `check_ranges(job, tier, side, num_blocks)`: the checks every
  tier-side handler makes of a job's tier spec.
- Cancellation (`cancellable`): a handler that honours `Job.cancel` between chunks, so that an
  engine that gave up on a load can recompute its blocks safely.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence

from tiercache.priority import lower_this_thread
from tiercache.tiers import Tier
from tiercache.transfer.job import Job, set_flags
from tiercache.transfer.specs import GPULoadStoreSpec, TierLoadStoreSpec

log = logging.getLogger(__name__)

EXPEDITED = "expedited"  # the lane of expedited jobs (see the module docstring)


def tier_of(tiers: Sequence[Tier], spec: TierLoadStoreSpec) -> Tier:
    """The tier a spec names, checked against its medium."""
    if not 0 <= spec.tier < len(tiers):
        raise ValueError(
            f"tier {spec.tier} ({spec.medium!r}) is not one of this handler's {len(tiers)} tiers"
        )
    tier = tiers[spec.tier]
    if tier.medium != spec.medium:
        raise ValueError(f"tier {spec.tier} is {tier.medium!r}, but the spec names {spec.medium!r}")
    return tier


def _inside(ids: tuple[int, ...], n: int) -> bool:
    """Every id in 0..n-1 (none: True). One id, a decode-time job's, without min and max."""
    if len(ids) == 1:
        return 0 <= ids[0] < n
    return not ids or (min(ids) >= 0 and max(ids) < n)


def check_ranges(job: Job, tier: Tier, side: TierLoadStoreSpec, num_blocks: int) -> None:
    """Slots inside the tier, engine block ids inside the engine buffer."""
    if not _inside(side.slots, tier.slot_count):
        raise ValueError(
            f"job {job.job_id}: slots outside tier {tier.medium!r} (slots 0..{tier.slot_count - 1})"
        )
    for spec in (job.src, job.dst):
        if isinstance(spec, GPULoadStoreSpec) and not _inside(spec.block_ids, num_blocks):
            raise ValueError(f"job {job.job_id}: engine block ids outside 0..{num_blocks - 1}")


class TransferHandler(ABC):
    """Moves the bytes of jobs between two mediums."""

    # Whether `Job.cancel` stops this handler's engine writes (see `tiercache.transfer.job`).
    cancellable = False

    def check(self, job: Job) -> None:  # noqa: B027 - optional hook
        """Validate `job` on the caller's thread before it is accepted; raise ValueError if
        it is malformed (e.g. a slot count that does not match)."""

    @abstractmethod
    def transfer_async(self, job: Job) -> bool:
        """Queue a checked `job` (its `deps` set) without blocking; False if this handler
        cannot take it now."""

    @abstractmethod
    def get_finished(self) -> list[Job]:
        """Jobs finished since the last call, each reported once."""

    def close(self, timeout: float | None = None) -> None:  # noqa: B027 - nothing to release
        """Finish queued jobs and join every thread (at most `timeout` seconds in all: a
        thread stuck in a hung tier is left behind, a daemon); idempotent."""


class LaneHandler(TransferHandler):
    """Jobs run in FIFO order per lane, each lane served by `threads` threads."""

    # Whether `run` only queues asynchronous work, so that it may run on the caller's thread.
    issues_inline = False

    def __init__(self, lanes: Mapping[str, int], *, name: str, lane_threads: int = 1) -> None:
        self._lane_threads = lane_threads
        self._lock = threading.Lock()
        # Jobs queued or running on each lane's threads, and the lock an inline job holds
        # while it runs (a lane thread's job ends, or a new one queues, before or after it).
        self._pending: dict[str, int] = {}
        self._idle = threading.Lock()
        self._closed = False
        if EXPEDITED in lanes:
            raise ValueError(f"lanes: {EXPEDITED!r} is reserved for expedited jobs")
        self._name = name
        self._lanes: dict[str, int] = {}
        self._queues: dict[str, queue.SimpleQueue[Job | None]] = {}
        self._issued: dict[str, deque[Job]] = {}
        self._threads: list[threading.Thread] = []
        for lane, n in lanes.items():
            self._start_lane(lane, n)

    # -- subclass hooks --------------------------------------------------------------------
    @abstractmethod
    def lane_of(self, job: Job) -> str:
        """The lane `job` runs on."""

    def expedited_lane_of(self, job: Job) -> str:
        """The lane of `job` when it is expedited (default: the one `EXPEDITED` lane)."""
        return EXPEDITED

    def background(self, lane: str) -> bool:
        """Whether nothing waits for `lane`'s jobs soon (copies between tiers): its threads
        run at a lower priority than the engine's (`tiercache.priority`)."""
        return False

    def prepare(self, job: Job) -> None:
        """Caller-thread work at submission (e.g. mark the compute stream's position)."""

    @abstractmethod
    def run(self, job: Job, lane: str) -> None:
        """Do the transfer on a lane thread: set `job.size`/`job.time`, `job.fail(...)` for
        blocks that did not arrive; raising fails the whole job."""

    def wait_deps(self, job: Job, lane: str) -> bool:
        """Block until the jobs `job` follows have finished; False if one it reads failed."""
        ok = True
        for dep, reads_it in job.deps:
            if reads_it is None:  # only overwrites what `dep` reads: its reads are enough
                dep.wait_reads()
            elif not dep.wait() and reads_it:
                ok = False
        return ok

    # -- TransferHandler -------------------------------------------------------------------
    def transfer_async(self, job: Job) -> bool:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        self.prepare(job)
        lane = self.expedited_lane_of(job) if job.expedited else self.lane_of(job)
        if lane not in self._queues:
            self._start_lane(lane, 1 if job.expedited else self._lane_threads)
        if self.issues_inline:
            with self._idle:
                if not self._pending[lane] and _all_issued(job.deps):
                    self._execute(job, lane)  # nothing to wait for on the host: issue it now
                    return True
                self._pending[lane] += 1
        self._queues[lane].put(job)
        return True

    def _start_lane(self, lane: str, threads: int) -> None:
        """Make a lane and start its threads: the declared ones at construction, the others
        on first use (most engines never expedite)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            if lane in self._queues:
                return
            self._queues[lane] = queue.SimpleQueue()
            self._issued[lane] = deque()
            self._pending[lane] = 0
            self._lanes[lane] = threads
            for i in range(threads):
                t = threading.Thread(
                    target=self._serve,
                    args=(lane,),
                    daemon=True,
                    name=f"tiercache-xfer-{self._name}-{lane}-{i}",
                )
                self._threads.append(t)
                t.start()

    def get_finished(self) -> list[Job]:
        out: list[Job] = []
        with self._lock:  # lanes are added under it too (`_start_lane`): no copy of the dict
            for issued in self._issued.values():
                # Per lane, jobs finish in issue order (one thread or stream per lane).
                while issued and issued[0].done():
                    out.append(issued.popleft())
        return out

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        with self._lock:  # no expedited lane starts after this
            self._closed = True
        for lane, n in self._lanes.items():
            for _ in range(n):
                self._queues[lane].put(None)  # one stop marker per thread, behind queued jobs
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))

    # -- lane threads ----------------------------------------------------------------------
    def _serve(self, lane: str) -> None:
        if self.background(lane):
            lower_this_thread()
        q = self._queues[lane]
        while (job := q.get()) is not None:
            self._execute(job, lane)
            if self.issues_inline:
                with self._idle:
                    self._pending[lane] -= 1

    def _execute(self, job: Job, lane: str) -> None:
        try:
            ok = self.wait_deps(job, lane)
            with job.fence:  # `Job.cancel` before this point stops it whatever the handler
                go = ok and not job.cancelled
                job.started = go
            if go:
                self.run(job, lane)
            else:
                job.fail()  # a dependency it reads failed, or the engine gave up on it
        except Exception as exc:
            # The thread boundary: any failure of a copy becomes success=False for its job
            # (the blocks are then recomputed or not stored); it must never kill the lane.
            log.warning("transfer job %s %s failed: %r", job.job_id, job.transfer_type, exc)
            job.fail()
            job.size = 0
        finally:
            with self._lock:
                self._issued[lane].append(job)
            set_flags(job.read_done, job.issued)  # in this order, under one lock


def _all_issued(deps: list[tuple[Job, bool | None]]) -> bool:
    """Whether every job in `deps` is issued (a loop: `all` over a generator costs more for
    the none or one a decode-time job has)."""
    for dep, _ in deps:  # noqa: SIM110 - see the docstring
        if not dep.issued.is_set():
            return False
    return True
