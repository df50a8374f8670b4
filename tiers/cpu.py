"""`CPUTier`: host-memory pool, pinned when CUDA is present (for async device copies)."""

from __future__ import annotations

from typing import ClassVar

import torch

from tiercache.tiers.pool import PoolTier


class CPUTier(PoolTier):
    """A contiguous uint8 pool in host memory, pinned when CUDA is available (asynchronous
    device copies) unless `pin_memory = false`."""

    kind: ClassVar[str] = "cpu"
    OPTIONS: ClassVar = {"pin_memory": bool}

    def __init__(
        self,
        *,
        name: str = "cpu",
        block_bytes: int,
        capacity_blocks: int,
        pin_memory: bool | None = None,
    ) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        super().__init__(
            name=name,
            block_bytes=block_bytes,
            capacity_blocks=capacity_blocks,
            device=torch.device("cpu"),
            pin_memory=pin_memory,
        )
        self.pinned = pin_memory
