"""Shared helpers for the transfer tests (no tests here): engine buffers in every layout,
a pool-less stand-in tier, handlers with injected delays and failures, and byte checks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pytest
import torch

from tiercache.tiers import Tier, check_blocks
from tiercache.transfer import CPUCopyHandler, DiskHandler, Job, OffloadingWorker

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
# Every engine-buffer test body runs on the CPU path and, where present, on CUDA.
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]

LAYOUTS = [
    "cross_layer",  # one allocation [num_blocks, layers, page]: a block is one run of bytes
    "layers_outer",  # one allocation [layers, num_blocks, page] (vLLM's CPU backend)
    "separate",  # one allocation per layer, blocks first
    "kv_separate",  # one allocation per layer, K/V first [2, num_blocks, ...] (GPU backends)
    "kv_shared",  # one allocation [layers, 2, num_blocks, ...], layer views
    "odd_bytes",  # pages of 6 bytes: no int64 view possible
]


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


def make_kv(
    kind: str, num_blocks: int, *, layers: int = 4, device: str = "cpu", seed: int = 0
) -> tuple[dict[str, torch.Tensor], bool]:
    """Random engine KV caches of a layout kind; returns (caches, kv_first)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        t = torch.randint(-(2**15), 2**15 - 1, shape, generator=g, dtype=torch.int16)
        return t.view(dtype).to(device) if dtype.itemsize == 2 else t.to(dtype).to(device)

    heads, bs, hd = 2, 4, 8
    if kind == "cross_layer":
        a = rand(num_blocks, layers, heads, bs, 2 * hd)
        return {f"layer.{i}": a[:, i] for i in range(layers)}, False
    if kind == "layers_outer":
        a = rand(layers, num_blocks, heads, bs, 2 * hd)
        return {f"layer.{i}": a[i] for i in range(layers)}, False
    if kind == "separate":
        return {f"layer.{i}": rand(num_blocks, heads, bs, 2 * hd) for i in range(layers)}, False
    if kind == "kv_separate":
        return {f"layer.{i}": rand(2, num_blocks, bs, heads, hd) for i in range(layers)}, True
    if kind == "kv_shared":
        a = rand(layers, 2, num_blocks, bs, heads, hd)
        return {f"layer.{i}": a[i] for i in range(layers)}, True
    if kind == "odd_bytes":
        return {f"layer.{i}": rand(num_blocks, 3, dtype=torch.int16) for i in range(layers)}, False
    raise AssertionError(kind)


def engine_block(caches: dict[str, torch.Tensor], kv_first: bool, b: int) -> list[torch.Tensor]:
    """Every layer's page(s) of engine block `b`, as CPU copies."""
    return [(t[:, b] if kv_first else t[b]).cpu().clone() for t in caches.values()]


def snapshot(caches, kv_first, ids: Sequence[int]) -> list[list[torch.Tensor]]:
    return [engine_block(caches, kv_first, b) for b in ids]


def assert_blocks(caches, kv_first, ids: Sequence[int], expected) -> None:
    for b, want in zip(ids, expected, strict=True):
        got = engine_block(caches, kv_first, b)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"engine block {b}"


def new_threads() -> list[str]:
    """Live threads started by the transfer handlers."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("tiercache-xfer-"))


class DictTier(Tier):
    """A pool-less tier (stand-in for NVMe/LMDB): blocks in a dict, with injectable faults.

    `bad_slots`: reads of these slots report failed positions; `raise_on_read`: reads raise
    OSError; every write is recorded in `writes`.
    """

    kind: ClassVar[str] = "dict"
    persistent: ClassVar[bool] = True

    def __init__(self, *, name: str = "dict", block_bytes: int, capacity_blocks: int) -> None:
        super().__init__(name=name, block_bytes=block_bytes, capacity_blocks=capacity_blocks)
        self.data: dict[int, tuple[bytes, torch.Tensor]] = {}
        self.bad_slots: set[int] = set()
        self.raise_on_read = False
        self.read_delay = 0.0
        self.writes: list[int] = []
        self.lock = threading.Lock()

    def write(self, slots, src, keys=None) -> None:
        check_blocks(src, len(slots), self.block_bytes, "src")
        assert keys is not None and len(keys) == len(slots)
        with self.lock:
            for i, s in enumerate(slots):
                self.data[s] = (keys[i], src[i].cpu().clone())
                self.writes.append(s)

    def read(self, slots, dst, keys=None) -> list[int]:
        check_blocks(dst, len(slots), self.block_bytes, "dst")
        time.sleep(self.read_delay)
        if self.raise_on_read:
            raise OSError("injected read failure")
        failed = []
        with self.lock:
            for i, s in enumerate(slots):
                entry = self.data.get(s)
                if s in self.bad_slots or entry is None or (keys and entry[0] != keys[i]):
                    failed.append(i)
                    continue
                dst[i].copy_(entry[1])
        return failed

    @classmethod
    def from_config(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> Tier:
        raise NotImplementedError


class SlowCopyHandler(CPUCopyHandler):
    """Stores (or loads) sleep before copying; `fail_jobs` raise instead of copying."""

    def __init__(
        self,
        *args: Any,
        store_delay: float = 0.0,
        load_delay: float = 0.0,
        fail_jobs: Sequence[int] = (),
        gate: dict[int, threading.Event] | None = None,
        **kw: Any,
    ) -> None:
        self.store_delay, self.load_delay = store_delay, load_delay
        self.fail_jobs = set(fail_jobs)
        self.gate = gate or {}
        super().__init__(*args, **kw)

    def run(self, job: Job, lane: str) -> None:
        if job.job_id in self.gate:
            self.gate[job.job_id].wait(10)
        time.sleep(self.store_delay if lane == "store" else self.load_delay)
        if job.job_id in self.fail_jobs:
            raise RuntimeError(f"injected failure of job {job.job_id}")
        super().run(job, lane)


class SlowDiskHandler(DiskHandler):
    """Tier-to-tier moves sleep before copying."""

    def __init__(self, *args: Any, delay: float = 0.05, **kw: Any) -> None:
        self.delay = delay
        super().__init__(*args, **kw)

    def run(self, job: Job, lane: str) -> None:
        time.sleep(self.delay)
        super().run(job, lane)


def register_pairs(worker: OffloadingWorker, handler, pairs: Sequence[tuple[str, str]]) -> None:
    for a, b in pairs:
        worker.register_handler(a, b, handler)


def drain(
    worker: OffloadingWorker,
    ids: Sequence[int],
    timeout: float = 10.0,
    poll: Callable[[], None] | None = None,
) -> dict[int, Any]:
    """Wait for `ids` and collect their results (each must come exactly once)."""
    worker.wait(ids)
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while set(ids) - got.keys():
        for r in worker.get_finished():
            assert r.job_id not in got, f"job {r.job_id} reported twice"
            got[r.job_id] = r
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs {set(ids) - got.keys()} never reported")
        time.sleep(0.001)
    return got
