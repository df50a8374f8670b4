"""The bottom file of `tiercache.connectors.vllm_offloading`: what its manager and worker
halves pass each other and share, with no behaviour of their own: keys (`offload_key_to_key`),
the names of their shared state in a `SharedStore`, the labels of vLLM's config-info metric
(`CONFIG_INFO_KEYS`, `config_info`), and the `LoadStoreSpec`s (`TierLoadSpec`,
`TierStoreSpec`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

from vllm.v1.kv_offload.base import LoadStoreSpec
from xxhash import xxh3_128_digest

from tiercache.cache import TierCache
from tiercache.records import LoadSpec
from tiercache.records import PrepareStoreOutput as TierPlan

log = logging.getLogger(__package__)  # the package's one logger (the former module's name)

_KEY_PREFIX = b"tiercache/vllm-offload-key/v1\x00"
BRIDGE_KEY = "vllm_offloading.bridge"
WORKER_KEY = "vllm_offloading.worker"  # SharedStore.state: the worker half runs here
# Tier kinds whose blocks live in memory; vLLM's events know only CPU and STORAGE mediums.
MEMORY_KINDS = frozenset({"cpu", "gpu"})


_F = TypeVar("_F", bound=Callable[..., Any])


def holding(lock_of: Callable[[Any], AbstractContextManager[Any]]) -> Callable[[_F], _F]:
    """A method decorator: run the method holding `lock_of(self)` (the manager half's
    `_locked`, the worker half's `_serialized`)."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            with lock_of(self):
                return fn(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def offload_key_to_key(namespace: str, key: bytes) -> bytes:
    """tiercache's 16-byte key for vLLM's `OffloadKey` (block hash + 4-byte group index)."""
    return xxh3_128_digest(_KEY_PREFIX + namespace.encode("utf-8") + b"\x00" + bytes(key))


CONFIG_INFO_KEYS = ("tiercache_tiers", "tiercache_block_bytes", "tiercache_promote")


def config_info(cache: TierCache) -> dict[str, str | int | bool]:
    """Static facts of `cache` for vLLM's info metric: tiers as ``kind:blocks`` fastest
    first, bytes per block, whether lower-tier hits are promoted."""
    return {
        "tiercache_tiers": ",".join(f"{t.kind}:{t.capacity_blocks}" for t in cache.tiers),
        "tiercache_block_bytes": cache.block_bytes,
        "tiercache_promote": bool(cache.config.promote),
    }


@dataclass(frozen=True)
class TierLoadSpec(LoadStoreSpec):
    """Where the blocks of a `prepare_load` live (tiercache's `LoadSpec`, keys in order), and
    `promote`: a plan copying the blocks served from lower tiers into the first tier once
    they are loaded (None when nothing is promoted)."""

    load: LoadSpec
    promote: TierPlan | None = None


@dataclass(frozen=True)
class TierStoreSpec(LoadStoreSpec):
    """A store plan: run `plan.moves` (demotions), then write `plan.stored_keys`. `keys`: the
    same keys in the order of the `prepare_store` call, which is the order of the engine
    blocks vLLM hands the worker."""

    plan: TierPlan
    keys: tuple[bytes, ...]
