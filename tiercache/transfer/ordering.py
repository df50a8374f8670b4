"""`DependencyTracker`: orders jobs that touch the same tier slots or engine blocks.

Handlers run in parallel (a thread or stream per direction, a thread pool for disks), so the
worker, which sees every job in submission order, records for each job the earlier jobs still
in flight that it must follow:
- read after write: a load of slots an earlier store or move writes (it fails if that fails:
  the bytes it would read never arrived);
- write after read: a store into slots an earlier move still reads (the manager releases a
  demoted block's slot in the same plan that reuses it); in a volatile tier it waits only
  until that move has read its source (`Job.read_done`), not for its write, which may hang
  on a disk; in a persistent tier (`durable`) it waits until the move has ended: the slot
  holds the block's only durable copy until the destination's is durable, and a kill
  between the overwrite and the destination's commit would lose an acknowledged block;
- write after write: two writes of one slot land in submission order.
Dependencies only point backwards in submission order and every handler starts its jobs in
that order, so the earliest unfinished job can always run: no deadlock.
"""

from __future__ import annotations

from collections.abc import Iterable

from tiercache.transfer.job import Job, Resource


class DependencyTracker:
    """Last writer and current readers of each resource, over jobs not yet reported."""

    def __init__(self, durable: Iterable[int] = ()) -> None:
        """`durable`: the indices of persistent tiers (see the module docstring)."""
        self._writer: dict[Resource, Job] = {}
        self._readers: dict[Resource, list[Job]] = {}
        self._durable = frozenset(durable)

    def dependencies(self, job: Job) -> list[tuple[Job, bool | None]]:
        """The jobs in flight that `job` must follow, each with whether `job` reads its bytes
        (None: `job` only overwrites what that one reads, so it follows only its reads).

        Read-only: call `record(job)` once the job is accepted by its handler.
        """
        writer, readers = self._writer, self._readers
        if not writer and not readers:  # nothing in flight (a lone decode-time job)
            return []
        deps: dict[int, tuple[Job, bool | None]] = {}
        for r in job.reads:
            w = writer.get(r)
            if w is not None:
                deps[id(w)] = (w, True)
        for r in job.writes:
            w = writer.get(r)
            if w is not None and id(w) not in deps:
                deps[id(w)] = (w, False)
            for rd in readers.get(r, ()):
                if id(rd) not in deps:
                    deps[id(rd)] = (rd, False if r[0] in self._durable else None)
        return list(deps.values())

    def record(self, job: Job) -> None:
        """Make later jobs follow `job` where they touch what it reads or writes."""
        readers, writer = self._readers, self._writer
        for r in job.reads:
            lst = readers.get(r)
            if lst is None:
                readers[r] = [job]
            else:
                lst.append(job)
        for r in job.writes:
            writer[r] = job
            readers.pop(r, None)  # later writers follow this one, which follows these readers

    def release(self, job: Job) -> None:
        """Forget a reported job: later jobs no longer need to wait for it."""
        writer, readers = self._writer, self._readers
        for r in job.writes:
            if writer.get(r) is job:
                del writer[r]
        for r in job.reads:
            lst = readers.get(r)
            if lst is not None:
                try:
                    lst.remove(job)
                except ValueError:
                    continue
                if not lst:
                    del readers[r]
        job.deps = []  # drop references so finished jobs can be collected

    def __len__(self) -> int:
        """Resources with a job in flight (for tests)."""
        return len(self._writer.keys() | self._readers.keys())
