"""Helpers the vLLM adapters share, re-exported for the docs and tests that name them here.
Each lives in a module of its own (no vLLM import, so each is unit-tested alone): `namespace`
(the user's config, the namespace, extra keys), `ranks` (tensor and data parallelism),
`kv_groups`, `stores` (one shared `TierCache` per process and configuration) and `probes`
(read-only probes).
"""

# ruff: noqa: F401  (the re-exports below)

from tiercache.connectors.namespace import kv_settings, kv_settings_digest
from tiercache.connectors.ranks import per_dp_rank_config, resolve_rank_config, with_nvme_siblings
from tiercache.connectors.stores import acquire_store, store_snapshots
