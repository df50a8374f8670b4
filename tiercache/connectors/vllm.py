"""The module vLLM loads (``kv_connector_module_path="tiercache.connectors.vllm"``): the KV
connector `TierCacheConnector`, the `TierCacheOffloadingSpec` for vLLM's own
``OffloadingConnector`` (``spec_module_path``) and the encoder-cache `TierCacheECConnector`.
Importing it imports vLLM; tiercache itself never does. See docs/vllm.md.
"""

from __future__ import annotations

from tiercache.connectors.vllm_ec import TierCacheECConnector
from tiercache.connectors.vllm_kv import (
    TierCacheConnector,
    TierCacheConnectorMetadata,
    TierCacheConnectorStats,
)
from tiercache.connectors.vllm_offloading import TierCacheOffloadingSpec

__all__ = [
    "TierCacheConnector",
    "TierCacheConnectorMetadata",
    "TierCacheConnectorStats",
    "TierCacheECConnector",
    "TierCacheOffloadingSpec",
]
