"""`OffloadingWorker`: the worker side of offloading; dispatches jobs to copy handlers.

Primitives: `register_handler(src_medium, dst_medium, handler)`, `transfer_async(job_id,
(src_spec, dst_spec), expedited=False) -> bool`, `get_finished() -> list[TransferResult]`,
`wait(job_ids, timeout=None) -> set[int]` (the ids still running), `cancel(job_id) -> bool`
(an engine load or store given up at its deadline), `take_stats()`, `close()`. One handler per
(source medium, destination medium); one handler object may serve several pairs. Call it
from one thread (the engine's worker thread).

Ordering: handlers run in parallel, so the worker records, for each job, the jobs still in
flight that touch the same tier slots or engine blocks (`DependencyTracker`), and the handler
starts it only after them. Submission order is therefore the only contract: a load submitted
after a store of the same slots reads the stored bytes, and a store submitted after the
demotion moves of its plan overwrites their slots only once they have been read. An
`expedited` job (a load the engine waits for within its step) still follows the jobs it
depends on, but not the handler's queue of regular jobs (`LaneHandler`).

An adapter (e.g. vLLM's connector worker) builds it once (`build_worker(layout, tiers)`),
submits a store plan's jobs at the start of the next step, moves first (`store_transfers`),
and a load's jobs, one per tier that serves part of the chain (`load_transfers`). Every step
it completes what finished: a store or move with `complete_store(arrived keys)` and
`complete_store(failed keys, success=False)`; a load with `complete_load(keys)` always (it
unpins), counted only if every job of the request succeeded (else its blocks are load errors,
recomputed, and `record_error(tier)`). `close()` at shutdown joins every thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from tiercache.transfer.handler import TransferHandler
from tiercache.transfer.job import Job
from tiercache.transfer.ordering import DependencyTracker
from tiercache.transfer.results import TransferResult, TransferType
from tiercache.transfer.specs import GPULoadStoreSpec, TierLoadStoreSpec, TransferSpec
from tiercache.transfer.stats import TransferStats

_SPECS = (GPULoadStoreSpec, TierLoadStoreSpec)  # a tuple: `X | Y` builds a union per call


class OffloadingWorker:
    """Dispatches transfers by (source medium, destination medium) and collects results."""

    def __init__(self, durable_tiers: Iterable[int] = ()) -> None:
        """`durable_tiers`: indices of persistent tiers, whose slots a store overwrites only
        after the moves reading them have ended (`DependencyTracker`)."""
        self._handlers: dict[TransferType, TransferHandler] = {}
        self._distinct: list[TransferHandler] = []  # each handler once, in registration order
        self._jobs: dict[int, tuple[Job, TransferHandler]] = {}
        self._tracker = DependencyTracker(durable_tiers)
        self._stats = TransferStats()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def handlers(self) -> dict[TransferType, TransferHandler]:
        return dict(self._handlers)

    def register_handler(self, src_medium: str, dst_medium: str, handler: TransferHandler) -> None:
        """Route transfers from `src_medium` to `dst_medium` to `handler`."""
        pair = (src_medium, dst_medium)
        if pair in self._handlers:
            raise ValueError(
                f"a handler for {src_medium!r} -> {dst_medium!r} is already registered"
            )
        self._handlers[pair] = handler
        self._distinct = list({id(h): h for h in self._handlers.values()}.values())

    def transfer_async(self, job_id: int, spec: TransferSpec, *, expedited: bool = False) -> bool:
        """Start a transfer without blocking; False (nothing changed) if no handler serves its
        mediums, ValueError for a malformed spec or a job id still in flight. `expedited`: the
        caller will wait for it soon; it does not queue behind regular jobs."""
        src, dst = spec
        if not (isinstance(src, _SPECS) and isinstance(dst, _SPECS)):
            bad = dst if isinstance(src, _SPECS) else src
            raise TypeError(
                f"spec: expected GPULoadStoreSpec or TierLoadStoreSpec, got {type(bad).__name__}"
            )
        handler = self._handlers.get((src.medium, dst.medium))
        if handler is None:
            return False
        job = Job(job_id, src, dst, expedited=expedited)
        with self._lock:
            if self._closed:
                raise RuntimeError("OffloadingWorker is closed")
            if job_id in self._jobs:
                raise ValueError(f"job_id: {job_id} is still in flight")
            handler.check(job)
            job.deps = self._tracker.dependencies(job)
            if not handler.transfer_async(job):
                return False
            self._tracker.record(job)
            self._jobs[job_id] = (job, handler)
        return True

    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs finished since the last call, each exactly once."""
        out: list[TransferResult] = []
        release, jobs = self._tracker.release, self._jobs
        with self._lock:
            for handler in self._distinct:
                for job in handler.get_finished():
                    release(job)
                    del jobs[job.job_id]
                    r = job.result()
                    if r.transfer_size:
                        self._stats.record_transfer(
                            r.transfer_size, r.transfer_time, r.transfer_type
                        )
                    out.append(r)
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> set[int]:
        """Block until the named jobs have finished (their results still come from
        `get_finished`), or `timeout` seconds have passed; returns the ids still running.
        Ids not in flight (unknown or already reported) are ignored."""
        with self._lock:
            jobs = [self._jobs[i][0] for i in job_ids if i in self._jobs]
        if timeout is None:
            for job in jobs:
                job.wait()
            return set()
        deadline = time.monotonic() + timeout
        for job in jobs:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            job.wait(left)
        return {job.job_id for job in jobs if not job.done()}

    def cancel(self, job_id: int) -> bool:
        """Give up on a job that touches engine blocks (a load or store past its deadline):
        True if its handler stops it, so that once this returns it copies no engine block any
        more (its result still comes from `get_finished`, failed where its bytes did not
        arrive, when it ends). False if it is not in flight or its handler cannot stop it
        (host and device pool copies: wait for them)."""
        with self._lock:
            entry = self._jobs.get(job_id)
        if entry is None:
            return False
        return entry[0].cancel(unstarted_only=not entry[1].cancellable)

    def take_stats(self) -> TransferStats | None:
        """Transfer stats since the last call (None when empty), as vLLM's connector reports
        them per step."""
        with self._lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, TransferStats()
            return stats

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet reported."""
        return len(self._jobs)

    def close(self, timeout: float | None = None) -> None:
        """Finish queued jobs and join every handler thread, waiting at most `timeout`
        seconds in all (threads stuck in a hung tier are left behind: daemons); idempotent.
        Results of jobs not yet reported remain available from `get_finished`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        end = None if timeout is None else time.monotonic() + timeout
        for handler in self._distinct:
            handler.close(None if end is None else max(0.0, end - time.monotonic()))

    def __enter__(self) -> OffloadingWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
