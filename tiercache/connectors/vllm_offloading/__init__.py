"""`TierCacheOffloadingSpec`: tiercache behind vLLM's own `OffloadingConnector` (0.32, 0.33).

Loaded by vLLM with ``kv_connector="OffloadingConnector"`` and ``kv_connector_extra_config=
{"spec_name": "TierCacheOffloadingSpec", "spec_module_path": "tiercache.connectors.vllm",
"config": <mapping or TOML path>}``. Primitives:

- `TierCacheOffloadingSpec(config)` (spec.py): an `OffloadingSpec`; `get_manager()` and
  `get_worker()`.
- `TierCacheSchedulerSide` (manager.py): vLLM's `OffloadingManager` (per `OffloadKey`) over
  tiercache's `OffloadingManager` (per 16-byte key).
- `TierCacheWorkerSide` (worker.py): vLLM's `OffloadingWorker` over tiercache's transfer
  engine. Both keep their names from before issue 50 as aliases.
- `TierLoadSpec`, `TierStoreSpec`, `offload_key_to_key`, `config_info` (specs.py, the bottom
  file); bridge.py carries the worker half's reports to the manager half.

Keys: vLLM gives the manager only `OffloadKey`s (block hash + group index), so tiercache's key
is ``xxh3_128(namespace + OffloadKey)``: with ``prefix_caching_hash_algo="xxhash"`` set
``PYTHONHASHSEED`` or persistent tiers never hit. Both halves share one `TierCache` per
process, so vLLM's world size must be 1. vLLM's `OffloadingConnector` cannot take a failed
transfer: a persistent block is verified before it is a hit, a failed store is reported done
(and failed to tiercache), a failed load stops the engine rather than computing on garbage,
and a late load is still waited for (its tier suspended). See docs/vllm-offloading.md.
"""

from tiercache.connectors.vllm_offloading.manager import (
    TierCacheOffloadingManager,
    TierCacheSchedulerSide,
)
from tiercache.connectors.vllm_offloading.spec import TierCacheOffloadingSpec
from tiercache.connectors.vllm_offloading.specs import (
    CONFIG_INFO_KEYS,
    TierLoadSpec,
    TierStoreSpec,
    config_info,
    offload_key_to_key,
)
from tiercache.connectors.vllm_offloading.worker import (
    TierCacheOffloadingWorker,
    TierCacheWorkerSide,
)

__all__ = [
    "CONFIG_INFO_KEYS",
    "TierCacheOffloadingManager",
    "TierCacheOffloadingSpec",
    "TierCacheOffloadingWorker",
    "TierCacheSchedulerSide",
    "TierCacheWorkerSide",
    "TierLoadSpec",
    "TierStoreSpec",
    "config_info",
    "offload_key_to_key",
]
