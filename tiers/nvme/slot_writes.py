"""Writing an NVMe tier's slots: `write_slots`, the data half of `NVMeTier.write`.

Each run of adjacent slots (`io.slot_runs`) is filled on the caller's thread (per slot: the
block's header, then its payload, in an aligned run buffer) and written with one `pwrite` on
the tier's `SlotPipeline` pool, while the next runs are filled. No journal record names these
slots yet: the tier appends the PUT records only after every run is written (and synced,
with fsync "always"), so a crash in between leaves slots that nothing indexes.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

import numpy as np

from tiercache.tiers.format import HEADER_SIZE, encode_block
from tiercache.tiers.nvme.io import AlignedBuffer, Slab, slot_runs


def write_slots(
    slab: Slab,
    *,
    ns: int,
    slots: Sequence[int],
    rows: np.ndarray,
    keys: Sequence[bytes],
    first_seq: int,
    medium: str,
) -> None:
    """Write `rows[i]` as block `keys[i]` (write seq `first_seq + i`, namespace id `ns`) into
    slot `slots[i]` of `slab`. Raises OSError naming how many blocks were lost when a
    run fails or comes back short (`medium` names the tier), and a bug's exception as is."""
    sb, bb, n = slab.slot_bytes, slab.block_bytes, len(slots)
    fd, pipeline = slab.fd, slab.pipeline
    runs = slot_runs(slots, pipeline.run_slots)

    def fill(r: int, buf: AlignedBuffer) -> None:
        for k, i in runs[r].members:
            at = k * sb
            payload = buf.arr[at + HEADER_SIZE : at + HEADER_SIZE + bb]
            payload[:] = rows[i]
            header, _ = encode_block(keys[i], payload, namespace=ns, seq=first_seq + i)
            buf.view[at : at + HEADER_SIZE] = header

    def put(r: int, buf: AlignedBuffer) -> int:
        run = runs[r]
        return os.pwrite(fd, buf.view[: run.count * sb], run.first * sb)

    def check(r: int, buf: AlignedBuffer, res: int | BaseException) -> BaseException | None:
        if isinstance(res, BaseException):
            return res
        run = runs[r]
        if res == run.count * sb:
            return None
        where = f"slot {run.first}" + (f"-{run.first + run.count - 1}" if run.count > 1 else "")
        return OSError(errno.EIO, f"short write to {where}: {res} of {run.count * sb} bytes")

    outcome = pipeline.run(len(runs), put, fill, check, writes=True)
    errors = [e for e in outcome if e]
    for e in errors:
        if not isinstance(e, OSError):
            raise e  # a bug, not an I/O failure
    if errors:
        lost = sum(run.count for run, e in zip(runs, outcome, strict=True) if e)
        raise OSError(
            getattr(errors[0], "errno", errno.EIO),
            f"{medium}: writing {lost} of {n} blocks failed: {errors[0]}",
        ) from errors[0]
