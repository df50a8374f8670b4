"""`TransferResult`: what the worker reports for each finished job, exactly once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from tiercache.records import slot_setters

# (source medium, destination medium), e.g. ("GPU", "cpu"); stats key it as "GPU_to_cpu".
TransferType: TypeAlias = tuple[str, str]


@dataclass(frozen=True, slots=True, init=False)
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

    def __init__(
        self,
        job_id: int,
        success: bool,
        transfer_size: int,
        transfer_time: float,
        transfer_type: TransferType,
        failed: tuple[int, ...] = (),
        gone: tuple[int, ...] = (),
    ) -> None:
        # `slot_setters`: every job reports one result.
        _set_job_id(self, job_id)
        _set_success(self, success)
        _set_transfer_size(self, transfer_size)
        _set_transfer_time(self, transfer_time)
        _set_transfer_type(self, transfer_type)
        _set_failed(self, failed)
        _set_gone(self, gone)


(
    _set_job_id,
    _set_success,
    _set_transfer_size,
    _set_transfer_time,
    _set_transfer_type,
    _set_failed,
    _set_gone,
) = slot_setters(TransferResult)
