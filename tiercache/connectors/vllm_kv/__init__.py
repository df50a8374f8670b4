"""`TierCacheConnector`, tiercache's vLLM `KVConnectorBase_V1`, split by role: `connector.py`
(the facade vLLM loads), `settings.py` (`KVSettings` and the tunables), `messages.py` (what
crosses between the roles), `scheduler.py` (`KVScheduler`, with `local_lookup.py` and
`remote_index.py`) and `worker.py` (`KVWorker`). Every name importable from the single module
it replaces is importable from here.
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
