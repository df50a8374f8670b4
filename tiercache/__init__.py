"""tiercache: a tiered KV-cache storage engine for LLM serving.

Public API: `TierCache`, `CacheConfig`, `OffloadingManager`, `prefix_hashes`, and the records
`OffloadingEvent`, `PrepareStoreOutput`, `LoadSpec`.
"""

from tiercache.cache import TierCache
from tiercache.config import CacheConfig, TierConfig
from tiercache.errors import BlockCorruptError, ConfigError, TierCacheError, TierUnavailableError
from tiercache.hashing import prefix_hashes
from tiercache.manager import OffloadingManager
from tiercache.records import (
    BlockMove,
    LoadSpec,
    OffloadingEvent,
    PrepareStoreOutput,
    StoreSpec,
    TierWrite,
)

__version__ = "0.1.0"

__all__ = [
    "BlockCorruptError",
    "BlockMove",
    "CacheConfig",
    "ConfigError",
    "LoadSpec",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "StoreSpec",
    "TierCache",
    "TierCacheError",
    "TierConfig",
    "TierUnavailableError",
    "TierWrite",
    "__version__",
    "prefix_hashes",
]
