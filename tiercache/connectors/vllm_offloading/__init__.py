"""`TierCacheOffloadingSpec`: tiercache behind vLLM's own `OffloadingConnector` (0.32, 0.33).

Loaded by vLLM with ``kv_connector="OffloadingConnector"`` and ``kv_connector_extra_config=
{"spec_name": "TierCacheOffloadingSpec", "spec_module_path": "tiercache.connectors.vllm",
"config": <mapping or TOML path>}``. Primitives:

- `TierCacheOffloadingSpec(config)`: an `OffloadingSpec`; `get_manager()` and `get_worker()`.
- `TierCacheSchedulerSide` (scheduler process; `TierCacheOffloadingManager` before issue 50):
  vLLM's `OffloadingManager` (per `OffloadKey`) over tiercache's
  `OffloadingManager` (per 16-byte key): lookup, prepare/complete load and store, events; on
  0.33 also `lock` (the shared store's reentrant lock), `config_info`, `on_reset_flushed`.
- `TierCacheWorkerSide` (worker process; `TierCacheOffloadingWorker` before issue 50):
  vLLM's `OffloadingWorker` over tiercache's transfer engine; one
  vLLM job becomes one tiercache job per tier (loads, then the promotion of lower-tier hits
  into the first tier) or the plan's moves plus the store. 0.33's expedited (synchronous)
  loads run on the transfer engine's expedited lanes.
- `TierLoadSpec`, `TierStoreSpec`: the `LoadStoreSpec`s passed from scheduler to worker.
- `offload_key_to_key(namespace, key)`: the tiercache key of a vLLM `OffloadKey`.

The adapters hold no caching logic. Keys: vLLM hashes blocks itself and gives the manager
only the hash (`OffloadKey` = block hash + group index), never the tokens, so tiercache's key
is ``xxh3_128(namespace + OffloadKey)``. vLLM's default sha256 block hashes are equal across
processes, so persistent tiers hit after a restart; with a non-cryptographic hash
(``prefix_caching_hash_algo="xxhash"``) set ``PYTHONHASHSEED`` or nothing persists.

The manager and worker halves share one `TierCache` per process (the scheduler decides slots,
the worker writes those slots), so vLLM's world size must be 1. The worker reports store
failures to the manager through a per-cache in-process queue; vLLM 0.32 does not accept a
failed transfer (its connector asserts success), so `lookup` reads and verifies a block whose
fastest copy is persistent before calling it a hit (a corrupt block is a miss, recomputed), a
failed store is reported to vLLM as done and to tiercache as failed (a future miss), and a
failed load is reported as failed, which stops the engine rather than letting it compute on
garbage. See docs/vllm-offloading.md.

Deadlines: for the same reason a late load cannot be abandoned here (vLLM would stop on the
failure). A load not finished `[deadlines] load_timeout` seconds after its submission
suspends its tier (the manager's circuit breaker): lookups skip the tier until its back-off
ends, so later requests recompute instead of queueing behind it; the late load itself is
still waited for. Use `TierCacheConnector` where a load must never hold a request back.
Stores: vLLM keeps a request's blocks until its store job is reported done (and `wait`s for
the jobs of a preempted request). A store part still running `store_timeout` seconds after
its submission (a hung disk) is stopped reading engine blocks, its tier suspended, and the
job goes on without it; so does a demotion (a move, which reads no engine block). vLLM then
gets its blocks back. Such a copy's keys are misses meanwhile, never "pending" (vLLM would
defer the request until the disk returns), and the manager completes them when the copy
ends: what a given-up store read before its deadline still lands. At shutdown the worker
waits for copies at most `store_timeout`, so the engine exits while a disk hangs.

Hybrid models (several KV cache groups): vLLM's `OffloadingConnector` keeps the hybrid KV
cache manager on (`SupportsHMA`), chooses per group what to store and load (sliding windows:
the window only), gives the manager one `OffloadKey` per block and group, and gives the worker
each group's blocks in group order (`GPULoadStoreSpec.group_sizes`) and tensors
(`CanonicalKVCaches.group_data_refs`). The spec refuses groups tiercache cannot serve
(`common.kv_groups`: Mamba and other non-attention state), names the groups in its namespace,
and copies every group through one block layout, which vLLM's overlay of the groups' tensors
makes exact (`_check_overlay`). `keys_to_store` keeps the order of the `prepare_store` call,
the order of the engine blocks vLLM lists for them.

The package: `specs` (the bottom file: keys, config info, the `LoadStoreSpec`s), `bridge`
(worker half -> manager half), `manager` (`TierCacheSchedulerSide`), `worker`
(`TierCacheWorkerSide`; deadlines via `tiercache.connectors.deadlines`) and `spec`
(`TierCacheOffloadingSpec`, engine discovery). Every name importable from the former module
`tiercache.connectors.vllm_offloading` is re-exported here; its submodules log as
``tiercache.connectors.vllm_offloading``.
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

log = logging.getLogger(__name__)  # the logger every submodule logs to (its package's)

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
