"""Tiers: the `Tier` ABC and a lazy registry from config kinds to tier classes.

- `tier_class(kind)`: the class for "cpu", "gpu", "nvme", "lmdb" (imported on first use).
- `build_tier(cfg, block_bytes)`: a tier from a validated `TierConfig`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from tiercache.errors import ConfigError
from tiercache.tiers.base import Tier, check_blocks

if TYPE_CHECKING:
    from tiercache.config import TierConfig

_KINDS: dict[str, str] = {
    "cpu": "tiercache.tiers.cpu:CPUTier",
    "gpu": "tiercache.tiers.gpu:GPUTier",
    "nvme": "tiercache.tiers.nvme:NVMeTier",
    "nvme-siblings": "tiercache.tiers.nvme.siblings:NVMeSiblingsTier",
    "lmdb": "tiercache.tiers.lmdb:LMDBTier",
    "redis": "tiercache.tiers.redis:RedisTier",
}

__all__ = ["Tier", "available_kinds", "build_tier", "check_blocks", "tier_class"]


def available_kinds() -> list[str]:
    """Kinds a config may name."""
    return sorted(_KINDS)


def tier_class(kind: str, field: str = "kind") -> type[Tier]:
    """The tier class registered for `kind`; ConfigError naming `field` when unknown."""
    path = _KINDS.get(kind)
    if path is None:
        raise ConfigError(
            field,
            f"unknown tier kind {kind!r}; expected one of "
            f"{', '.join(repr(k) for k in available_kinds())}",
        )
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(field, f"tier kind {kind!r} is not available: {exc}") from None
    return cls


def build_tier(cfg: TierConfig, block_bytes: int, *, namespace: str = "") -> Tier:
    """Build the tier a validated `TierConfig` describes."""
    return tier_class(cfg.kind, f"{cfg.field}.kind").from_config(
        cfg, block_bytes, namespace=namespace
    )
