"""The records that cross between the connector's two roles (as vLLM's `offloading/common.py`),
pickled by vLLM between processes, so each is a plain dataclass of bytes, ints and strings:

- `LoadJob`, `StoreJob` in `TierCacheConnectorMetadata`: scheduler -> worker, each step.
- `TierCacheWorkerMetadata`: worker -> scheduler, each step (events, finished store plans,
  suspended tiers, cost samples, damaged keys); `aggregate` combines the TP ranks'.
- `TierCacheHandshake`: worker -> scheduler at start-up (the keys recovered per medium).
- `TierCacheConnectorStats`: the counters either role reports to vLLM's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tiercache.records import LoadSpec

# A cache event: (keys, medium, removed); in worker metadata, first the worker's TP rank.
Event = tuple[tuple[bytes, ...], str, bool]
RankEvent = tuple[int, tuple[bytes, ...], str, bool]


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Load `keys` into engine `block_ids`. Local placement: a synchronous load, `spec` the
    plan the scheduler pinned (None: nothing left to pin). Remote: a load the worker plans
    itself, asynchronous unless `sync` (the scheduler found every block in a memory tier: it
    loads before the step's forward). Blocks the worker cannot find or read become load
    errors."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    spec: LoadSpec | None = None
    remote: bool = False
    asynchronous: bool = False  # hybrid models: reported by get_finished even when local
    sync: bool = False  # remote: loaded before this step's forward (memory tiers only)


@dataclass(frozen=True, slots=True)
class StoreJob:
    """Save engine `block_ids` (completed by this step's forward) under `keys`."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    groups: tuple[int, ...] = ()  # hybrid models: the KV cache group of each key
    tokens: int = 0  # hybrid models: tokens the job covers (every group's blocks among them)


@dataclass
class TierCacheConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: loads, stores, and requests whose blocks vLLM keeps
    until the worker reports their stores finished."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    delayed: list[str] = field(default_factory=list)
    preempted: bool = False
    step_tokens: int = 0  # tokens this step computes: the worker times its forward


@dataclass
class TierCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step (module doc). `aggregate` combines the TP ranks': events
    of every rank, plan counts summed (the scheduler expects one report per plan and rank),
    the longest suspension per medium."""

    events: list[RankEvent] = field(default_factory=list)
    plans_done: dict[str, int] = field(default_factory=dict)
    suspended: dict[str, float] = field(default_factory=dict)
    # Cost samples: (tier, bytes, seconds) per load job, (tokens, seconds) per forward.
    load_samples: list[tuple[str, int, float]] = field(default_factory=list)
    forward_samples: list[tuple[int, float]] = field(default_factory=list)
    # Keys whose bytes failed verification at a load: never offered again by the probes.
    bad: list[bytes] = field(default_factory=list)
    # Keys the cache dropped from a shared tier that the store still holds and the cache
    # finds again (forgotten, not deleted): still loadable, so not removed for routers.
    kept: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TierCacheWorkerMetadata)
        self.events.extend(other.events)
        self.load_samples.extend(other.load_samples)
        self.forward_samples.extend(other.forward_samples)
        self.bad.extend(other.bad)
        self.kept.extend(other.kept)
        for r, n in other.plans_done.items():
            self.plans_done[r] = self.plans_done.get(r, 0) + n
        for m, sec in other.suspended.items():
            self.suspended[m] = max(sec, self.suspended.get(m, 0.0))
        return self


@dataclass
class TierCacheHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up, one per TP rank: the keys the worker's cache holds per
    medium (recovered from persistent tiers), so a restarted engine hits from its first step."""

    held: dict[str, tuple[bytes, ...]] = field(default_factory=dict)  # medium -> keys
    rank: int = 0


@dataclass
class TierCacheConnectorStats(KVConnectorStats):
    """Counters since the last report: blocks looked up, loaded, stored, errors, bytes."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
