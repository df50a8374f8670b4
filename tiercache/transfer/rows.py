"""Row copies: `dst[dst_idx[i]] = src[src_idx[i]]` along dim 0, in as few calls as the
devices allow (the layout's copies between engine blocks, pool rows and buffers).

Primitives:
- `copy_rows(dst, dst_idx, src, src_idx, split=..., plan=...)`: the copy.
- `RowPlan(dst_idx, src_idx)`: what `copy_rows` works out from two index lists, made once
  when several tensors are copied by the same lists.
- `paired_runs(dst_idx, src_idx)`: the maximal runs where both indices step by one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import numpy as np
import torch

# On CPU, runs of at least this many bytes on average are copied one memcpy each (numpy's
# copyto), which then beats one `index_copy_`; gathers use index_select at any size.
LOOP_MIN_BYTES = 32 * 1024
# Up to this many runs, slice copies beat building index tensors on any device.
FEW_RUNS = 4
# A load this large (bytes), copied on CPU by run, is split between the calling thread and a
# helper: the engine waits for a load with its cores idle, and one thread's memcpy does not
# use all of the memory bandwidth.
SPLIT_MIN_BYTES = 4 << 20
_helper: list[ThreadPoolExecutor | None] = []  # decided on first use, then kept
_helper_lock = threading.Lock()


def _copy_helper() -> ThreadPoolExecutor | None:
    """The helper thread for split copies, started on first use; None on one CPU."""
    with _helper_lock:
        if not _helper:
            getaff = getattr(os, "sched_getaffinity", None)
            cpus = len(getaff(0)) if getaff is not None else (os.cpu_count() or 1)
            _helper.append(
                ThreadPoolExecutor(1, thread_name_prefix="tiercache-copy-helper")
                if cpus >= 2
                else None
            )
        return _helper[0]


def paired_runs(dst_idx: Sequence[int], src_idx: Sequence[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of the maximal runs where both indices step by one."""
    runs: list[tuple[int, int, int]] = []
    n = len(dst_idx)
    i = 0
    while i < n:
        d0, s0 = dst_idx[i], src_idx[i]
        k = 1
        while i + k < n and dst_idx[i + k] == d0 + k and src_idx[i + k] == s0 + k:
            k += 1
        runs.append((d0, s0, k))
        i += k
    return runs


def halves(
    runs: list[tuple[int, int, int]],
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """`runs` cut into two lists of (about) equal rows, a run split where the middle falls."""
    half = sum(k for _, _, k in runs) // 2
    first: list[tuple[int, int, int]] = []
    for i, (d, s, k) in enumerate(runs):
        if k >= half:
            if half:
                first.append((d, s, half))
            rest = [(d + half, s + half, k - half)] if k > half else []
            return first, rest + runs[i + 1 :]
        first.append((d, s, k))
        half -= k
    return first, []


def _is_run(idx: Sequence[int]) -> bool:
    if isinstance(idx, range):
        return idx.step == 1
    return (
        len(idx) > 0
        and idx[-1] - idx[0] == len(idx) - 1
        and all(b - a == 1 for a, b in pairwise(idx))
    )


def _index(idx: Sequence[int], device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(list(idx), dtype=torch.int64)
    if device.type == "cuda":  # pinned + non_blocking: no stream-wide sync for a pageable copy
        return t.pin_memory().to(device, non_blocking=True)
    return t


class RowPlan:
    """What `copy_rows` works out from a pair of index lists (their paired runs, whether each
    is one run, index tensors per device), once for every segment of a job: a 32-layer
    layout copies the same block ids 32 times (on CUDA each index tensor is a host->device
    copy of its own)."""

    def __init__(self, dst_idx: Sequence[int], src_idx: Sequence[int]) -> None:
        if len(dst_idx) != len(src_idx):
            raise ValueError(
                f"copy_rows: {len(dst_idx)} destination rows for {len(src_idx)} source rows"
            )
        self.dst_idx, self.src_idx = dst_idx, src_idx
        self.runs = paired_runs(dst_idx, src_idx)
        self.dst_run, self.src_run = _is_run(dst_idx), _is_run(src_idx)
        self._tensors: dict[tuple[str, torch.device], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.dst_idx)

    def index(self, side: str, device: torch.device) -> torch.Tensor:
        """The "dst" or "src" indices as an int64 tensor on `device` (made once)."""
        t = self._tensors.get((side, device))
        if t is None:
            t = _index(self.dst_idx if side == "dst" else self.src_idx, device)
            self._tensors[side, device] = t
        return t


def copy_rows(
    dst: torch.Tensor,
    dst_idx: Sequence[int],
    src: torch.Tensor,
    src_idx: Sequence[int],
    *,
    non_blocking: bool = False,
    split: bool = False,
    plan: RowPlan | None = None,
) -> None:
    """`dst[dst_idx[i]] = src[src_idx[i]]` along dim 0, in as few calls as the devices allow.

    Across devices: one slice copy per run (a DMA each). On one device: slice copies for a few
    runs or large rows on CPU, else one `index_select` and/or `index_copy_`. `split`: a large
    copy by runs on CPU is shared with a helper thread (loads, which the engine waits for).
    `plan`: the `RowPlan` of these two index lists, when several tensors are copied by them.
    """
    if plan is None:
        plan = RowPlan(dst_idx, src_idx)
    n = len(plan)
    if n == 0:
        return
    runs = plan.runs
    check_runs(runs, dst.shape[0], src.shape[0])
    row_bytes = src[0].numel() * src.element_size()
    same = dst.device == src.device
    cpu = same and dst.device.type == "cpu"
    split = split and row_bytes * n >= SPLIT_MIN_BYTES
    if not same or len(runs) <= FEW_RUNS:
        _copy_runs(dst, src, runs, cpu, non_blocking, split)
        return
    if plan.dst_run:  # a gather: index_select is memcpy speed on every device
        d0 = plan.dst_idx[0]
        torch.index_select(src, 0, plan.index("src", src.device), out=dst[d0 : d0 + n])
        return
    if cpu and row_bytes * n >= LOOP_MIN_BYTES * len(runs):
        _copy_runs(dst, src, runs, cpu, non_blocking, split)
        return
    if plan.src_run:
        s0 = plan.src_idx[0]
        dst.index_copy_(0, plan.index("dst", dst.device), src[s0 : s0 + n])
        return
    dst.index_copy_(
        0, plan.index("dst", dst.device), src.index_select(0, plan.index("src", src.device))
    )


def check_runs(runs: list[tuple[int, int, int]], nd: int, ns: int) -> None:
    """IndexError for a run (dst start, src start, length) past either end: a slice past the
    end would copy less, silently."""
    for d, s, k in runs:
        if d < 0 or s < 0 or d + k > nd or s + k > ns:
            raise IndexError(
                f"copy_rows: rows {d}..{d + k} <- {s}..{s + k} out of range "
                f"({nd} destination, {ns} source rows)"
            )


def _numpy(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor (sharing memory), or None for dtypes numpy lacks."""
    try:
        return t.numpy()
    except (TypeError, RuntimeError):
        return None


def _copy_runs(
    dst: torch.Tensor,
    src: torch.Tensor,
    runs: list[tuple[int, int, int]],
    cpu: bool,
    non_blocking: bool,
    split: bool = False,
) -> None:
    """One slice copy per run: memcpy through numpy views on CPU (it releases the GIL too),
    `copy_` otherwise (a DMA across devices). `split` (CPU): the rows are halved between this
    thread and the helper (`_copy_helper`), which copies the second half meanwhile."""
    if cpu:
        dn, sn = _numpy(dst), _numpy(src)
        if dn is not None and sn is not None:
            helper = _copy_helper() if split else None
            mine, theirs = halves(runs) if helper is not None else (runs, [])
            done = None
            if helper is not None and theirs:
                done = helper.submit(_copy_runs, dst, src, theirs, cpu, non_blocking)
            try:
                for d, s, k in mine:
                    np.copyto(dn[d : d + k], sn[s : s + k])
            finally:  # the helper's half is done (or failed) before the caller goes on
                if done is not None:
                    done.result()
            return
    for d, s, k in runs:
        dst[d : d + k].copy_(src[s : s + k], non_blocking=non_blocking)
