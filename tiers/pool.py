"""`PoolTier`: one contiguous uint8 tensor `[capacity, block_bytes]` on a device.

Shared by the pinned-CPU tier and the GPU tier: same code, a different device. Copies are
batched: a contiguous run of slots is one slice copy; otherwise one `index_copy_` /
`index_select` over an int64 view (on uint8, index_copy_ runs ~9x slower, see shared/limits).

Stream order: on a CUDA pool, `read`/`write` (the facade's copies, demotions) are queued on the
device's current stream and return before they finish. Each records an event, `fence`, after
its copy; the CUDA copy handler makes its lane stream wait on the fence of the pool it is
about to use, so a worker job never reads a slot before the facade's write into it landed.
On the CPU, copies are done when they return and `fence` stays None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tiercache.tiers.base import Tier, check_blocks


def _run_start(slots: Sequence[int]) -> int | None:
    """The first slot when `slots` is one ascending run (s, s+1, ...), else None."""
    first = slots[0]
    if slots[-1] - first != len(slots) - 1:
        return None
    for i, s in enumerate(slots):
        if s != first + i:
            return None
    return first


def _wide(t: torch.Tensor) -> torch.Tensor:
    """An int64 view of a uint8 block tensor when its geometry allows, else the tensor."""
    if t.shape[-1] % 8 == 0 and t.storage_offset() % 8 == 0:
        try:
            return t.view(torch.int64)
        except RuntimeError:
            return t
    return t


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
        super().__init__(name=name, block_bytes=block_bytes, capacity_blocks=capacity_blocks)
        self._device = device
        self._pool = torch.empty(
            (capacity_blocks, block_bytes), dtype=torch.uint8, device=device, pin_memory=pin_memory
        )
        if device.type == "cpu" and not pin_memory:
            # Fault the pages in now: first-touch faults otherwise cut the first pass over the
            # pool to a fraction of memcpy speed (pinned and device memory are already backed).
            self._pool.zero_()
        self._pool_wide = _wide(self._pool)
        self._async = device.type == "cuda"  # copies queue on a stream and return at once
        self._fence: Any = None

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

    def close(self) -> None:
        super().close()
        # Drop the reference so the (possibly pinned or device) memory goes back now.
        self._pool = self._pool_wide = torch.empty(0, dtype=torch.uint8)
