"""`PoolTier`: one contiguous uint8 tensor `[capacity, block_bytes]` on a device.

Shared by the pinned-CPU tier and the GPU tier: same code, a different device. Copies are
batched: a contiguous run of slots is one slice copy; otherwise one `index_copy_` /
`index_select` over an int64 view (index ops on uint8 elements are much slower).

Stream order: on a CUDA pool, `read`/`write` (the facade's copies, demotions) are queued on the
device's current stream and return before they finish. Each records an event, `fence`, after
its copy; the CUDA copy handler makes its lane stream wait on the fence of the pool it is
about to use, so a worker job never reads a slot before the facade's write into it landed.
On the CPU, copies are done when they return and `fence` stays None.

Start-up: an unpinned CPU pool is faulted in on a background thread (first-touch faults
would slow the first pass over it), with `madvise(MADV_POPULATE_WRITE)`, which backs pages
without touching their contents, so it is safe while blocks are written. Where the kernel
refuses it (Linux < 5.14) the pool is zeroed in the constructor.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tiercache.tiers.base import (
    PAGE_BYTES,
    Tier,
    check_blocks,
    check_geometry,
    host_memory_bytes,
    libc_madvise,
)


def _run_start(slots: Sequence[int]) -> int | None:
    """The first slot when `slots` is one ascending run (s, s+1, ...), else None."""
    first = slots[0]
    if slots[-1] - first != len(slots) - 1 or any(s != first + i for i, s in enumerate(slots)):
        return None
    return first


log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux >= 5.14: populate (prefault) page tables writable
POPULATE_CHUNK = 64 << 20  # bytes per madvise call: a close waits for at most one


class _Prefault:
    """Faults a CPU tensor's pages in on a daemon thread (see the module docstring)."""

    def __init__(self, t: torch.Tensor, name: str) -> None:
        self.done = threading.Event()
        self._stop = threading.Event()
        self._madvise = libc_madvise()
        # The whole pages inside `t`'s bytes (madvise wants page-aligned addresses).
        start = -(-t.data_ptr() // PAGE_BYTES) * PAGE_BYTES
        end = (t.data_ptr() + t.numel() * t.element_size()) // PAGE_BYTES * PAGE_BYTES
        first = min(start + POPULATE_CHUNK, end)
        if first > start and self._madvise(start, first - start, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
        self._thread = threading.Thread(
            target=self._run, args=(first, end), name=f"tiercache-prefault-{name}", daemon=True
        )
        self._thread.start()

    def _run(self, a: int, end: int) -> None:
        try:
            while a < end and not self._stop.is_set():
                n = min(POPULATE_CHUNK, end - a)
                if self._madvise(a, n, MADV_POPULATE_WRITE) != 0:
                    return  # e.g. out of memory: the rest faults in on first use
                a += n
        finally:
            self.done.set()

    def stop(self) -> None:
        """Stop and wait (at most one chunk): the memory may be freed afterwards."""
        self._stop.set()
        self._thread.join()


def _wide(t: torch.Tensor) -> torch.Tensor:
    """An int64 view of a uint8 block tensor when its geometry allows, else the tensor."""
    if t.shape[-1] % 8 == 0 and t.storage_offset() % 8 == 0:
        try:
            return t.view(torch.int64)
        except RuntimeError:
            return t
    return t


def memory_bytes(device: torch.device) -> int | None:
    """The memory a pool on `device` can have at most: physical RAM for the host, the card's
    total for a CUDA device; None where unknown."""
    if device.type == "cpu":
        return host_memory_bytes()
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


class PoolTier(Tier):
    """Blocks in one preallocated tensor on `device`; batched gathers and scatters."""

    def __init__(
        self,
        *,
        name: str,
        block_bytes: int,
        capacity_blocks: int,
        device: torch.device,
        pin_memory: bool = False,
    ) -> None:
        # Refused before allocating anything, the base's slot stack included: a pinned
        # allocation past the host's memory need not fail fast, and a pageable pool larger
        # than RAM could only swap.
        check_geometry(block_bytes, capacity_blocks)
        need, have = capacity_blocks * block_bytes, memory_bytes(device)
        if have is not None and need > have:
            where = "host memory" if device.type == "cpu" else f"{device}'s memory"
            raise MemoryError(
                f"{name}: {capacity_blocks} blocks of {block_bytes} bytes ({need} bytes) exceed "
                f"the {have} bytes of {where}"
            )
        super().__init__(name=name, block_bytes=block_bytes, capacity_blocks=capacity_blocks)
        self._device = device
        self._pool = torch.empty(
            (capacity_blocks, block_bytes), dtype=torch.uint8, device=device, pin_memory=pin_memory
        )
        # Pinned and device memory are backed already; an unpinned CPU pool is faulted in
        # on a background thread (see the module docstring), or zeroed now.
        self._prefault: _Prefault | None = None
        if device.type == "cpu" and not pin_memory and self._pool.numel():
            try:
                self._prefault = _Prefault(self._pool, name)
            except OSError as exc:
                log.debug("%s: no background prefault (%s); zeroing the pool", name, exc)
                self._pool.zero_()
        self._pool_wide = _wide(self._pool)
        self._async = device.type == "cuda"  # copies queue on a stream and return at once
        self._fence: Any = None

    @classmethod
    def from_config(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> PoolTier:
        """The pool a validated `TierConfig` describes: its options are the constructor's."""
        return cls.from_options(cfg, block_bytes, (), **cfg.options)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def fence(self) -> Any:
        """The CUDA event recorded after this pool's last own copy (None: nothing pending)."""
        return self._fence

    def _mark(self) -> None:
        """After a copy: on an asynchronous device, record where the current stream is."""
        if self._async:
            self._fence = torch.cuda.current_stream(self._device).record_event()

    @property
    def pool(self) -> torch.Tensor:
        """The backing tensor (for copy handlers that move bytes without this class)."""
        return self._pool

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(slots, dtype=torch.int64, device=self._device)

    def write(
        self, slots: Sequence[int], src: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> None:
        n = len(slots)
        check_blocks(src, n, self.block_bytes, "src")
        if n == 0:
            return
        first = _run_start(slots)
        if first is not None:
            self._pool[first : first + n].copy_(src)
        else:
            if src.device != self._device:
                src = src.to(self._device)
            wide = _wide(src)
            target = self._pool_wide if wide.dtype == self._pool_wide.dtype else self._pool
            target.index_copy_(0, self._index(slots), wide)
        self._mark()

    def read(
        self, slots: Sequence[int], dst: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> list[int]:
        n = len(slots)
        check_blocks(dst, n, self.block_bytes, "dst")
        if n == 0:
            return []
        first = _run_start(slots)
        if first is not None:
            dst.copy_(self._pool[first : first + n])
        elif dst.device != self._device:
            dst.copy_(self._pool.index_select(0, self._index(slots)))
        else:
            wide = _wide(dst)
            source = self._pool_wide if wide.dtype == self._pool_wide.dtype else self._pool
            torch.index_select(source, 0, self._index(slots), out=wide)
        self._mark()  # a later write into these slots (after they are freed) waits for this
        return []

    @property
    def prefaulted(self) -> bool:
        """True once every page of the pool is backed (tests, benchmarks)."""
        return self._prefault is None or self._prefault.done.is_set()

    def wait_prefaulted(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds for the background prefault; whether it is done.
        An engine about to serve waits: pages faulted in while it serves slow its first
        requests (the faults and the prefault take the cores its forward needs)."""
        return self._prefault is None or self._prefault.done.wait(timeout)

    def close(self) -> None:
        super().close()
        if self._prefault is not None:
            self._prefault.stop()
        # Drop the reference so the (possibly pinned or device) memory goes back now.
        self._pool = self._pool_wide = torch.empty(0, dtype=torch.uint8)
