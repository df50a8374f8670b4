"""Deadlines of the transfers a vLLM adapter has in flight: the one home of the rules both
adapters (`vllm_kv` and `vllm_offloading`) apply to a hung tier.

`Flights` is the table of an adapter's transfer jobs in flight, each due by its kind, with the
scan for jobs newly late, the bounded wait and the bounded shutdown; `warn_late` is the one
warning for a late transfer. What happens to a late transfer is each adapter's policy,
passed in as a callback: the KV connector abandons a late load (vLLM recomputes its blocks);
vLLM's OffloadingConnector cannot take a failed load, so the spec still waits for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Generic, Protocol, TypeVar

from tiercache.config import DeadlineConfig

CLOSE_WAIT_S = 1.0  # how long closing the engine waits for threads after some were left behind


class Transfers(Protocol):
    """What `Flights` needs of the transfer engine (`tiercache.transfer.OffloadingWorker`)."""

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> set[int]:
        """Block until the jobs ended or `timeout` passed; the ids still running."""
        ...

    def cancel(self, job_id: int) -> bool:
        """Stop a job touching engine blocks; False if it cannot be stopped."""
        ...

    def close(self, timeout: float | None = None) -> None: ...


class Flight(Protocol):
    """What `Flights` needs of an adapter's record of one transfer job."""

    @property
    def kind(self) -> str:  # "load" (tier -> engine), "store" (engine -> tier), "move"
        ...

    @property
    def tier(self) -> int: ...


R = TypeVar("R", bound=Flight)


def warn_late(
    log: logging.Logger, kind: str, blocks: int, tier: int, outcome: str, seconds: float
) -> None:
    """The warning for a transfer of `kind` past its deadline: what became of it (`outcome`),
    and how long its tier is suspended (`seconds`)."""
    log.warning(
        "tiercache: a %s of %d blocks %s tier %d missed its deadline; %s, and the tier is "
        "skipped for %.1f s",
        kind,
        blocks,
        "from" if kind == "load" else "into",
        tier,
        outcome,
        seconds,
    )


class Flights(Generic[R]):
    """An adapter's transfer jobs in flight, by job id, with their deadlines."""

    def __init__(
        self,
        transfers: Transfers,
        deadlines: DeadlineConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transfers = transfers
        self.deadlines = deadlines
        self._clock = clock
        self._records: dict[int, R] = {}
        self._due: dict[int, float] = {}
        self._late: set[int] = set()  # past their deadline and handled (each once)

    # -- the table -----------------------------------------------------------------------
    def timeout(self, kind: str) -> float:
        """Seconds a transfer of `kind` may take: `load_timeout` for a load into the engine,
        `store_timeout` for a store or a move."""
        d = self.deadlines
        return d.load_timeout if kind == "load" else d.store_timeout

    def add(self, job_id: int, record: R) -> float:
        """Record a job just submitted; returns the time (of the clock) it is due by."""
        if job_id in self._records:
            raise ValueError(f"job_id: {job_id} is still in flight")
        due = self._clock() + self.timeout(record.kind)
        self._records[job_id] = record
        self._due[job_id] = due
        return due

    def pop(self, job_id: int) -> tuple[R, bool]:
        """Forget a job that ended: its record, and whether it had been past its deadline."""
        record = self._records.pop(job_id)
        del self._due[job_id]
        was_late = job_id in self._late
        self._late.discard(job_id)
        return record, was_late

    def get(self, job_id: int) -> R | None:
        return self._records.get(job_id)

    def __getitem__(self, job_id: int) -> R:
        return self._records[job_id]

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[int]:
        return iter(self._records)

    def items(self) -> Iterator[tuple[int, R]]:
        return iter(self._records.items())

    def due(self, job_id: int) -> float:
        return self._due[job_id]

    # -- deadlines -----------------------------------------------------------------------
    def is_late(self, job_id: int) -> bool:
        """Whether the job was past its deadline and handled (`mark_late`)."""
        return job_id in self._late

    def mark_late(self, job_id: int) -> None:
        """The job is past its deadline and its adapter handled it: `late` skips it now."""
        if job_id in self._records:
            self._late.add(job_id)

    def late(self, now: float | None = None, where: Callable[[R], bool] | None = None) -> list[int]:
        """Jobs due by `now` (the clock's time if None) not yet handled as late, in the
        order of their submission; only those whose record satisfies `where`, if given."""
        t = self._clock() if now is None else now
        return [
            j
            for j, r in self._records.items()
            if j not in self._late and t >= self._due[j] and (where is None or where(r))
        ]

    def until_due(self, job_ids: Iterable[int]) -> float:
        """Seconds from now until the last of `job_ids` (in flight) is due; 0 if past."""
        dues = [self._due[j] for j in job_ids if j in self._due]
        return max(0.0, max(dues) - self._clock()) if dues else 0.0

    def wait_or_give_up(
        self,
        job_ids: Iterable[int],
        timeout: float,
        give_up: Callable[[set[int]], None],
        still_wait: Callable[[int], bool] | None = None,
    ) -> set[int]:
        """The bounded wait: wait at most `timeout` seconds for `job_ids`; those still
        running then go to `give_up` (the adapter's policy), after which the ones `still_wait`
        keeps (all, if None) are waited for without bound. Returns the late ids."""
        late = self.transfers.wait(job_ids, timeout)
        if late:
            give_up(late)
            self.transfers.wait([j for j in late if still_wait is None or still_wait(j)])
        return late

    def shutdown(
        self,
        left_behind: Callable[[int, R], None],
        log: logging.Logger,
        *,
        noun: str = "transfers",
        timeout: float | None = None,
    ) -> set[int]:
        """The bounded shutdown: wait for every job in flight at most `timeout` seconds
        (`store_timeout` if None). Those still running then are in a hung tier: each is
        cancelled and given to `left_behind` (which suspends its tier, so the cache's close
        writes nothing back into it), with one warning naming how many `noun` were left
        behind. Returns their ids; `close_transfers` is the caller's next step."""
        wait_s = self.deadlines.store_timeout if timeout is None else timeout
        late = self.transfers.wait(list(self._records), wait_s)
        for j in late:
            self.transfers.cancel(j)
            left_behind(j, self._records[j])
        if late:
            log.warning(
                "tiercache: %d %s into or out of hung tiers still ran at shutdown; left "
                "behind (their blocks are not stored)",
                len(late),
                noun,
            )
        return late

    def close_transfers(self, left: Collection[int]) -> None:
        """Close the transfer engine after `shutdown`: waiting for its threads without bound
        if nothing was `left` behind, else at most `CLOSE_WAIT_S` (stuck ones are daemons)."""
        self.transfers.close(timeout=CLOSE_WAIT_S if left else None)
