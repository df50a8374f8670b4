"""Helpers the vLLM adapters share, re-exported for code that imports them from here: one
module each (no vLLM import, so each is unit-tested alone): `namespace` (the user's config,
the namespace, extra keys), `ranks` (tensor and data parallelism), `kv_groups`, `stores` (one
shared `TierCache` per process and configuration) and `probes` (read-only probes).
"""

# ruff: noqa: F401  (the re-exports below)

from tiercache.connectors.kv_groups import KVGroup, groups_tag, hit_end, kv_groups, window_positions
from tiercache.connectors.namespace import (
    CONFIG_KEY,
    derive_namespace,
    extra_keys_for,
    kv_settings,
    kv_settings_digest,
    namespace_from_vllm,
    read_user_config,
    resolve_config,
)
from tiercache.connectors.probes import open_probes, probe_chain
from tiercache.connectors.ranks import (
    RankConfig,
    per_dp_rank_config,
    per_rank_config,
    per_rank_telemetry,
    prepare_rank_dirs,
    rank_suffix,
    resolve_rank_config,
    with_nvme_siblings,
)
from tiercache.connectors.stores import (
    SharedStore,
    acquire_store,
    find_store,
    release_store,
    store_snapshots,
)
