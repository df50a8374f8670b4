"""`TierCacheOffloadingSpec`: tiercache behind vLLM's own `OffloadingConnector` (0.32, 0.33).

Loaded by vLLM with ``kv_connector="OffloadingConnector"`` and ``kv_connector_extra_config=
{"spec_name": "TierCacheOffloadingSpec", "spec_module_path": "tiercache.connectors.vllm",
"config": <mapping or TOML path>}``. Primitives:

- `TierCacheOffloadingSpec(config)`: an `OffloadingSpec`; `get_manager()` and `get_worker()`
  (spec.py).
- `TierCacheSchedulerSide` (manager.py): vLLM's `OffloadingManager` (per `OffloadKey`) over
  tiercache's `OffloadingManager` (per 16-byte key).
- `TierCacheWorkerSide` (worker.py): vLLM's `OffloadingWorker` over tiercache's transfer
  engine. Both keep their names from before issue 50 as aliases.
- `TierLoadSpec`, `TierStoreSpec`, `offload_key_to_key`, `config_info` (specs.py, the bottom
  file); bridge.py carries the worker half's reports to the manager half.

Keys: vLLM gives the manager only the hash (`OffloadKey` = block hash + group index), never
the tokens, so tiercache's key is ``xxh3_128(namespace + OffloadKey)``. vLLM's default sha256
block hashes are equal across processes; with ``prefix_caching_hash_algo="xxhash"`` set
``PYTHONHASHSEED`` or persistent tiers never hit.

Both halves share one `TierCache` per process (the scheduler decides slots, the worker writes
them), so vLLM's world size must be 1. vLLM's `OffloadingConnector` asserts that every
transfer succeeded, so: a block whose fastest copy is persistent is read and verified before
it is a hit (a corrupt block is a recomputed miss); a failed store is reported to vLLM as done
and to tiercache as failed; a failed load is reported as failed, which stops the engine
rather than computing on garbage. Deadlines: a late load suspends its tier but is still
waited for; a store or a demotion past `store_timeout` is stopped reading engine blocks,
detached from vLLM's job and its tier suspended (its keys are misses until it ends). Use
`TierCacheConnector` where a load must never hold a request back. Hybrid models: vLLM keeps its
hybrid KV cache manager on (`SupportsHMA`) and keys each block with its group; the spec
refuses groups tiercache cannot serve (`kv_groups`) and copies every group through one block
layout, which vLLM's overlay of the groups' tensors makes exact. See docs/vllm-offloading.md.
"""

import logging

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

log = logging.getLogger(__name__)  # the logger every submodule logs to

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
