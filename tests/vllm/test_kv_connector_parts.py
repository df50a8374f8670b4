"""The connector's small records against vLLM's real base classes (no engine needed)."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tiercache.connectors.vllm import (
    TierCacheConnector,
    TierCacheConnectorMetadata,
    TierCacheConnectorStats,
)
from tiercache.connectors.vllm_kv import (
    LoadJob,
    StoreJob,
    TierCacheHandshake,
    TierCacheWorkerMetadata,
)


def test_connector_implements_every_abstract_method_of_vllms_base() -> None:
    assert issubclass(TierCacheConnector, KVConnectorBase_V1)
    assert not TierCacheConnector.__abstractmethods__


def test_worker_metadata_aggregates_across_workers() -> None:
    a = TierCacheWorkerMetadata(events=[((b"k" * 16,), "cpu", False)], plans_done={"r1": 1})
    b = TierCacheWorkerMetadata(events=[((b"k" * 16,), "cpu", True)], plans_done={"r1": 2, "r2": 1})
    out = a.aggregate(b)
    assert isinstance(out, KVConnectorWorkerMetadata)
    assert out.plans_done == {"r1": 3, "r2": 1}
    assert [e[2] for e in out.events] == [False, True]


def test_metadata_crosses_process_boundaries() -> None:
    # Multiprocess vLLM pickles scheduler output and worker replies between processes.
    meta = TierCacheConnectorMetadata(
        loads=[LoadJob("r", (b"a" * 16,), (3,), None, True)],
        stores=[StoreJob("r", (b"b" * 16,), (4,))],
        delayed=["q"],
    )
    assert isinstance(meta, KVConnectorMetadata)
    back = pickle.loads(pickle.dumps(meta))
    assert back == meta
    hs = TierCacheHandshake(held={"nvme": (b"c" * 16,)})
    assert pickle.loads(pickle.dumps(hs)) == hs


def test_stats_aggregate_and_reduce() -> None:
    s = TierCacheConnector.build_kv_connector_stats({"loaded_blocks": 2})
    assert isinstance(s, TierCacheConnectorStats) and not s.is_empty()
    s.aggregate(TierCacheConnectorStats(data={"loaded_blocks": 3, "bytes": 10}))
    assert s.reduce() == {"loaded_blocks": 5, "bytes": 10}
    s.reset()
    assert s.is_empty()
