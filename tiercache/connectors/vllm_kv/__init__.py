"""`TierCacheConnector`, tiercache's vLLM `KVConnectorBase_V1`, split by role.

- `connector.py`: `TierCacheConnector`, the facade vLLM loads (one delegation per method).
- `settings.py`: `KVSettings` (parsed once from vLLM's config) and the tunables.
- `messages.py`: what crosses from the scheduler process to the worker process and back.
- `scheduler.py`: `KVScheduler` (request state, matching, store planning, events), with
  `local_lookup.py` (verified lookups on a shared store) and `remote_index.py` (the index of
  the workers' keys, and probes of the shared tiers).
- `worker.py`: `KVWorker` (engine buffer, loads, stores, deadlines, shutdown).

Every name importable from the single module it replaces is importable from here.
"""

from tiercache.connectors.vllm_kv.connector import TierCacheConnector, open_scheduler, open_worker
from tiercache.connectors.vllm_kv.messages import (
    LoadJob,
    StoreJob,
    TierCacheConnectorMetadata,
    TierCacheConnectorStats,
    TierCacheHandshake,
    TierCacheWorkerMetadata,
)
from tiercache.connectors.vllm_kv.scheduler import KVScheduler
from tiercache.connectors.vllm_kv.settings import (
    BAD_KEYS_MAX,
    IDLE_WAIT_S,
    MOVE_WAIT_S,
    PROBE_WAIT_S,
    SETTLE_KEY,
    SETTLE_WAIT_S,
    VERIFY_WAIT_S,
    KVSettings,
)
from tiercache.connectors.vllm_kv.worker import KVFlight, KVWorker

__all__ = [
    "BAD_KEYS_MAX",
    "IDLE_WAIT_S",
    "MOVE_WAIT_S",
    "PROBE_WAIT_S",
    "SETTLE_KEY",
    "SETTLE_WAIT_S",
    "VERIFY_WAIT_S",
    "KVFlight",
    "KVScheduler",
    "KVSettings",
    "KVWorker",
    "LoadJob",
    "StoreJob",
    "TierCacheConnector",
    "TierCacheConnectorMetadata",
    "TierCacheConnectorStats",
    "TierCacheHandshake",
    "TierCacheWorkerMetadata",
    "open_scheduler",
    "open_worker",
]
