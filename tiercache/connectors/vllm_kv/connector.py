"""`TierCacheConnector`: tiercache as a vLLM `KVConnectorBase_V1` (vLLM 0.32 and 0.33).

Loaded by vLLM with ``kv_connector="TierCacheConnector"``, ``kv_connector_module_path=
"tiercache.connectors.vllm"``, ``kv_connector_extra_config={"config": <mapping or TOML>}``.
The facade delegates each vLLM method to its role: `KVScheduler` (keys and block ids, never
bytes: scheduler.py) or `KVWorker` (bytes, through tiercache's transfer engine: worker.py).
docs/vllm.md is the user's account.

Two placements, chosen when the scheduler role starts (`open_scheduler`):
- local (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the worker is built first, in this process):
  both roles share one `TierCache`; lookups ask the manager and pin the hit, verifying blocks
  held only in persistent tiers first (`local_lookup.py`).
- remote (vLLM's default multiprocess mode, and always with TP > 1): the worker owns the
  cache; the scheduler answers from an index of the workers' keys and probes of the shared
  tiers (`remote_index.py`). Loads are asynchronous, and a block that cannot be loaded is a
  load error: set ``kv_load_failure_policy="recompute"``.

``kv_role``: "kv_both" loads and stores, "kv_producer" only stores, "kv_consumer" only loads.
Tensor parallel: block keys are the same on every rank (the scheduler hashes once); a key is a
hit only when every rank holds it, and a store plan is finished when every rank reported it
(`TierCacheWorkerMetadata.aggregate`). Pipeline (and context) parallel size must be 1. Hybrid
models (`SupportsHMA`): one key per block and KV cache group (`hashing.group_keys`), a hit is
the longest prefix every group serves, and a failed load fails the request's receive.
Deadlines (``[deadlines]``) and cost-aware loading (``[loading]``): see worker.py and
scheduler.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tiercache.connectors.probes import open_probes
from tiercache.connectors.ranks import prepare_rank_dirs
from tiercache.connectors.stores import acquire_store, find_store
from tiercache.connectors.vllm_kv.messages import (
    TierCacheConnectorMetadata,
    TierCacheConnectorStats,
)
from tiercache.connectors.vllm_kv.scheduler import KVScheduler
from tiercache.connectors.vllm_kv.settings import SETTLE_KEY, KVSettings, log
from tiercache.connectors.vllm_kv.worker import KVWorker
from tiercache.connectors.vllm_logging import follow_vllm_logging
from tiercache.tiers.base import StoreProbe

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def open_scheduler(settings: KVSettings) -> KVScheduler:
    """The scheduler role for `settings`, in the local or the remote placement (module doc);
    the remote one probes each rank's shared tiers when it loads."""
    shared = None
    if settings.tp_size == 1:
        local = find_store(settings.config)
        if local is not None and SETTLE_KEY in local.state:
            shared = acquire_store(settings.config, settings.block_bytes)
    probes: list[list[tuple[str, StoreProbe]]] = []
    if shared is None and settings.loads_on:
        probes = [open_probes(c, settings.block_bytes) for c in settings.rank_configs]
    return KVScheduler(settings, shared, probes)


def open_worker(settings: KVSettings) -> KVWorker:
    """The worker role for `settings`: it always opens (or shares) this rank's store."""
    if settings.rank is not None:
        prepare_rank_dirs(settings.rank)
    return KVWorker(settings, acquire_store(settings.config, settings.block_bytes))


class TierCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """The facade of the module doc: `scheduler` or `worker`, by role; the other is None."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        follow_vllm_logging()
        worker = role == KVConnectorRole.WORKER
        self.settings = settings = KVSettings.from_vllm(vllm_config, kv_cache_config, worker=worker)
        self.scheduler: KVScheduler | None = None if worker else open_scheduler(settings)
        self.worker: KVWorker | None = open_worker(settings) if worker else None
        self.local = worker or (self.scheduler is not None and self.scheduler.local)
        if settings.hma:
            log.info(
                "TierCacheConnector: %d KV cache groups (%s), one key per block and group",
                len(settings.groups),
                ", ".join(f"{g.kind} x{len(g.layers)}" for g in settings.groups),
            )
        log.info(
            "TierCacheConnector (%s, %s, TP rank %d of %d): namespace %s, %d-byte blocks of "
            "%d tokens",
            role.name,
            "shared store" if self.local else "index of the worker's keys",
            settings.tp_rank,
            settings.tp_size,
            settings.config.namespace,
            settings.block_bytes,
            settings.block_size,
        )

    def _s(self) -> KVScheduler:
        assert self.scheduler is not None, "a scheduler-role call on the worker role"
        return self.scheduler

    def _w(self) -> KVWorker:
        assert self.worker is not None, "a worker-role call on the scheduler role"
        return self.worker

    def _meta(self) -> TierCacheConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TierCacheConnectorMetadata)
        return meta

    # -- both roles ----------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        role = self.scheduler or self.worker
        stats = role.take_stats() if role is not None else {}
        return TierCacheConnectorStats(data=stats) if stats else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return TierCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33 asks before enabling sleep mode: no, so vLLM refuses
        ``enable_sleep_mode=True`` at start-up. The worker holds views of the engine's KV
        tensors, which sleep mode unmaps and maps again at wake-up; following it would need
        testing on CUDA, the only platform with sleep mode."""
        return False

    def shutdown(self) -> None:
        """Shut the role down (it drops its reference to the store)."""
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # -- scheduler role ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s().update_connector_output(connector_output)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._s().set_xfer_handshake_metadata(metadata)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this instead of `request_finished` (`SupportsHMA`), with every group's
        block ids; what is stored was planned step by step, so it is the same."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._s().take_events()

    # -- worker role ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.get_handshake_metadata() if self.worker is not None else None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta() if self.worker is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._w().bind()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._w().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole blocks carry every layer: start_load_kv waited for them

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Blocks are saved whole (all layers) after the forward, in wait_for_save.
        return None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._w().handle_preemptions(kv_connector_metadata)

    def wait_for_save(self) -> None:
        self._w().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._w().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        return self._w().transfer_results(sending, recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().get_block_ids_with_load_errors()
