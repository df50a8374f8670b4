"""The transfer engine: the worker side that moves KV bytes between the engine's paged buffer
and the tiers without stalling the model.

- `specs`: `GPULoadStoreSpec`, `TierLoadStoreSpec`, and the transfers of a manager plan
  (`load_transfers`, `store_transfers`, `move_transfer`).
- `worker`: `OffloadingWorker` (dispatch by medium pair, ordering, results, stats).
- `results`: `TransferResult`.
- `kv_layout`: `KVLayout`, the engine buffer (both layouts, shared allocations,
  `block_size_factor`).
- `cpu_handler`, `cuda_handler`, `disk_handler`: the copy handlers; `factory.build_worker`
  wires them for a list of tiers.
- `stats`: `TransferStats`, `PrometheusMetrics`.
"""

from tiercache.transfer.cpu_handler import CPUCopyHandler
from tiercache.transfer.disk_handler import DiskHandler
from tiercache.transfer.factory import build_worker
from tiercache.transfer.handler import LaneHandler, TransferHandler
from tiercache.transfer.job import Job
from tiercache.transfer.kv_layout import KVLayout
from tiercache.transfer.results import TransferResult, TransferType
from tiercache.transfer.specs import (
    ENGINE_MEDIUM,
    GPULoadStoreSpec,
    TierLoadStoreSpec,
    TransferSpec,
    load_transfers,
    move_transfer,
    store_transfers,
)
from tiercache.transfer.stats import PrometheusMetrics, TransferOp, TransferStats
from tiercache.transfer.worker import OffloadingWorker

__all__ = [
    "ENGINE_MEDIUM",
    "CPUCopyHandler",
    "CUDACopyHandler",
    "DiskHandler",
    "GPULoadStoreSpec",
    "Job",
    "KVLayout",
    "LaneHandler",
    "OffloadingWorker",
    "PrometheusMetrics",
    "TierLoadStoreSpec",
    "TransferHandler",
    "TransferOp",
    "TransferResult",
    "TransferSpec",
    "TransferStats",
    "TransferType",
    "build_worker",
    "load_transfers",
    "move_transfer",
    "store_transfers",
]


def __getattr__(name: str) -> object:
    # The CUDA handler imports lazily, like the tier registry: nothing CUDA-specific loads on
    # CPU-only use.
    if name == "CUDACopyHandler":
        from tiercache.transfer.cuda_handler import CUDACopyHandler

        return CUDACopyHandler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
