"""`build_worker(layout, tiers)`: an `OffloadingWorker` with a handler for every pair it needs.

- engine <-> each tier with a `pool` tensor (CPU, GPU tiers): `CUDACopyHandler` when the engine
  buffer is on CUDA, else `CPUCopyHandler` (one handler for all of them, both directions);
- engine <-> each other tier (NVMe, LMDB) and every tier -> tier pair (demotions, write-back,
  promotion copies): one `DiskHandler`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiercache.tiers import Tier
from tiercache.transfer.cpu_handler import CPUCopyHandler
from tiercache.transfer.disk_handler import DiskHandler
from tiercache.transfer.handler import TransferHandler
from tiercache.transfer.kv_layout import KVLayout
from tiercache.transfer.specs import ENGINE_MEDIUM
from tiercache.transfer.worker import OffloadingWorker


def build_worker(
    layout: KVLayout, tiers: Sequence[Tier], *, disk_threads: int = 2, chunk_bytes: int = 64 * 2**20
) -> OffloadingWorker:
    """A worker for `tiers` (the manager's, fastest first) and the engine buffer `layout`."""
    mediums = [t.medium for t in tiers]
    if len(set(mediums)) != len(mediums):
        raise ValueError(f"tiers: medium names must be distinct, got {mediums}")
    if ENGINE_MEDIUM in mediums:
        raise ValueError(f"tiers: {ENGINE_MEDIUM!r} names the engine buffer; rename the tier")
    for t in tiers:
        if t.block_bytes != layout.block_bytes:
            raise ValueError(
                f"tier {t.medium!r}: blocks of {t.block_bytes} bytes, but the KV "
                f"layout's offloaded block is {layout.block_bytes} bytes"
            )
    worker = OffloadingWorker(i for i, t in enumerate(tiers) if t.persistent)
    handlers: dict[str, TransferHandler] = {}

    def handler(kind: str) -> TransferHandler:
        # Built on first use only: a handler owns threads, and only registered ones are closed.
        if kind not in handlers:
            if kind == "disk":
                handlers[kind] = DiskHandler(
                    tiers, layout, threads=disk_threads, chunk_bytes=chunk_bytes
                )
            elif layout.device.type == "cuda":
                from tiercache.transfer.cuda_handler import CUDACopyHandler

                handlers[kind] = CUDACopyHandler(layout, tiers)
            else:
                handlers[kind] = CPUCopyHandler(layout, tiers)
        return handlers[kind]

    for t in tiers:
        h = handler("copy" if getattr(t, "pool", None) is not None else "disk")
        worker.register_handler(ENGINE_MEDIUM, t.medium, h)
        worker.register_handler(t.medium, ENGINE_MEDIUM, h)
    for a in tiers:
        for b in tiers:
            if a is not b:
                worker.register_handler(a.medium, b.medium, handler("disk"))
    return worker
