"""`TransferResult`: what the worker reports for each finished job, exactly once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from tiercache.records import slotted_init

# (source medium, destination medium), e.g. ("GPU", "cpu"); stats key it as "GPU_to_cpu".
TransferType: TypeAlias = tuple[str, str]


@slotted_init  # every job reports one result
@dataclass(frozen=True, slots=True)
class TransferResult:
    """One finished job.

    `success` is True only when every block's bytes arrived. `transfer_size` counts the bytes
    of the blocks that arrived, `transfer_time` is the copy's own duration in seconds (queueing
    excluded). `failed` lists positions (offloaded blocks, indices into the job's tier slots)
    that did not arrive; empty on success, every position when the whole job failed. `gone`:
    those of `failed` whose source was a shared store that no longer held them (another
    process, or the store's capacity, evicted them; `Tier.sort_failed`): plain misses, which
    the caller counts as no error of the tier.
    """

    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float
    transfer_type: TransferType
    failed: tuple[int, ...] = ()
    gone: tuple[int, ...] = ()
