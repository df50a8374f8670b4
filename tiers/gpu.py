"""`GPUTier`: a block pool in device memory (spare HBM, or a peer GPU).

Without CUDA it refuses to start, unless the config says `device = "cpu"` explicitly, which
builds the same pool on the CPU (the CPU twin used by tests).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tiercache.errors import ConfigError, TierUnavailableError
from tiercache.tiers.pool import PoolTier


def resolve_device(spec: str, field: str = "device") -> torch.device:
    """A torch device for a GPU tier: "cuda", "cuda:N", or the explicit CPU twin "cpu"."""
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ConfigError(
            field, f"{spec!r} is not a device; use 'cuda', 'cuda:N' or 'cpu'"
        ) from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(
            field, f"a gpu tier needs a 'cuda' device (or 'cpu' for tests), got {spec!r}"
        )
    if not torch.cuda.is_available():
        raise TierUnavailableError(
            f"{field}: CUDA is not available on this machine, so a gpu tier on {spec!r} cannot "
            'start; remove the tier or set device = "cpu" to run its CPU twin'
        )
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise TierUnavailableError(
            f"{field}: {spec!r} does not exist ({torch.cuda.device_count()} CUDA device(s))"
        )
    return dev


class GPUTier(PoolTier):
    """A contiguous uint8 pool in device memory."""

    kind: ClassVar[str] = "gpu"
    OPTIONS: ClassVar = {"device": str}

    def __init__(
        self, *, name: str = "gpu", block_bytes: int, capacity_blocks: int, device: str = "cuda"
    ) -> None:
        super().__init__(
            name=name,
            block_bytes=block_bytes,
            capacity_blocks=capacity_blocks,
            device=resolve_device(device),
        )
