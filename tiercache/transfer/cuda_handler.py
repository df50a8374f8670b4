"""`CUDACopyHandler`: the CPU handler's twin on CUDA, a stream per direction.

A job whose lane is idle and whose dependencies are issued is queued on the caller's thread
(`LaneHandler.issues_inline`); otherwise its lane's thread (expedited jobs have a stream of
their own) does it. Either way the lane's stream waits (on the device, not the host) for the
previous jobs the job follows and for the caller's compute stream as it was at submission,
then runs the job's copy (`KVLayout.copy_mode`: one kernel launch for every layer, straight
into the pinned CPU tier, by default), and records an event. `get_finished()` polls the
events in order; `Job.wait()` synchronizes only that job's event. Index and layout logic is
`KVLayout`'s, shared with the CPU path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiercache.tiers import Tier
from tiercache.transfer.cpu_handler import CPUCopyHandler
from tiercache.transfer.handler import EXPEDITED
from tiercache.transfer.job import Job
from tiercache.transfer.kv_layout import KVLayout


class CUDACopyHandler(CPUCopyHandler):
    """Engine blocks on a CUDA device <-> rows of a pinned CPU or GPU pool tier."""

    issues_inline = True  # `run` queues copies on a stream and returns

    def __init__(self, layout: KVLayout, tiers: Sequence[Tier], *, name: str = "cuda") -> None:
        if layout.device.type != "cuda":
            raise ValueError(
                f"layout: the engine buffer is on {layout.device}, not CUDA; use CPUCopyHandler"
            )
        self._index = layout.device.index  # an int: cheaper for torch to resolve per job
        self._caller: tuple[int, torch.cuda.Stream] | None = None  # (raw handle, stream)
        self._marks: list[torch.cuda.Event] = []  # compute marks free for reuse
        self._starts: list[torch.cuda.Event] = []  # timing start events free for reuse
        self._streams = {
            lane: torch.cuda.Stream(layout.device) for lane in ("store", "load", EXPEDITED)
        }
        super().__init__(layout, tiers, name=name)

    def prepare(self, job: Job) -> None:
        # Copies must see what the model wrote (stores) and land after what it last read
        # (loads): mark the caller's current stream now; the lane's stream waits for it. The
        # stream is looked up by its raw handle (cheaper than `torch.cuda.current_stream`).
        handle = torch._C._cuda_getCurrentRawStream(self._index)
        caller = self._caller
        if caller is None or caller[0] != handle:
            caller = self._caller = (handle, torch.cuda.current_stream(self._index))
        try:
            mark = self._marks.pop()
        except IndexError:
            mark = torch.cuda.Event()
        mark.record(caller[1])
        job.compute_event = mark

    def wait_deps(self, job: Job, lane: str) -> bool:
        stream = self._streams[lane]
        ok = True
        for dep, reads_it in job.deps:
            # Host jobs are finished once issued (their reads once `read_done`: enough when
            # this job only overwrites what they read); CUDA jobs are queued.
            (dep.read_done if reads_it is None else dep.issued).wait()
            if dep.end_event is not None:
                stream.wait_event(dep.end_event)
            if reads_it and not dep.ok:
                ok = False
        stream.wait_event(job.compute_event)
        # The wait is queued with what the mark held at this call: recording the event again
        # for a later job cannot move it, so the mark is free for reuse from here.
        self._marks.append(job.compute_event)
        job.compute_event = None
        # The pool's own copies (the facade's writes, demotions) run on the device's current
        # stream, not this one: wait for the last of them before touching its slots.
        fence = self.pool_fence(job)
        if fence is not None:
            stream.wait_event(fence)
        return ok

    def run(self, job: Job, lane: str) -> None:
        stream = self._streams[lane]
        # The stream goes to the copy itself: no stream switch on the caller's thread.
        try:
            start = self._starts.pop()
        except IndexError:
            start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        job.start_event = start
        try:
            self.copy(job, non_blocking=True, stream=stream)
        finally:
            # Even a job that failed half way is done only when its queued copies are.
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            job.end_event = end

    def get_finished(self) -> list[Job]:
        done = super().get_finished()
        for job in done:
            # Time a finished job now, and give its start event back: nothing else reads it
            # (its end event stays: later jobs and waiters may still hold it).
            start = job.start_event
            if start is not None:
                if job.ok:
                    job.time = start.elapsed_time(job.end_event) / 1000.0
                job.start_event = None
                self._starts.append(start)
        return done

    def close(self, timeout: float | None = None) -> None:
        super().close(timeout)
        for s in self._streams.values():
            s.synchronize()
