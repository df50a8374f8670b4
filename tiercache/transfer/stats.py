"""Transfer statistics and Prometheus metrics.

Primitives:
- `TransferStats`: per transfer type ("GPU_to_cpu", "cpu_to_nvme", ...) the bytes and seconds
  of each operation: `record_transfer`, `aggregate`, `reduce`, `is_empty`, `reset`, with the
  semantics of vLLM's `OffloadingConnectorStats` (what a connector returns per step).
- `PrometheusMetrics`: prometheus-client metrics in a registry of its own (several can live in
  one process): transfer bytes, time and size histogram labelled by `transfer_type`, and per
  tier gauges (used, capacity) and counters (hits, misses, evictions, errors) fed from
  `TierCache.stats()` / `OffloadingManager.stats()`. It observes from outside; nothing in the
  core imports it. `start_http_server(port, addr)` serves the registry (127.0.0.1 by default).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import start_http_server as _start_http_server

from tiercache.transfer.results import TransferType


def transfer_key(transfer_type: TransferType | str) -> str:
    """("GPU", "cpu") -> "GPU_to_cpu"; a string is taken as already keyed."""
    if isinstance(transfer_type, str):
        return transfer_type
    src, dst = transfer_type
    return f"{src}_to_{dst}"


@dataclass(frozen=True, slots=True)
class TransferOp:
    """One finished transfer: bytes moved and seconds it took."""

    size: int
    time: float


@dataclass
class TransferStats:
    """Operations per transfer type over an interval."""

    data: dict[str, list[TransferOp]] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def record_transfer(
        self, num_bytes: int, time: float, transfer_type: TransferType | str
    ) -> None:
        self.data.setdefault(transfer_key(transfer_type), []).append(TransferOp(num_bytes, time))

    def aggregate(self, other: TransferStats) -> TransferStats:
        """Add `other`'s operations to this one (in place; returns self). `other` is unchanged."""
        for k, ops in other.data.items():
            self.data.setdefault(k, []).extend(ops)
        return self

    def reduce(self) -> dict[str, int | float]:
        """`{type}_total_bytes` and `{type}_total_time` per transfer type."""
        out: dict[str, int | float] = {}
        for k, ops in self.data.items():
            out[f"{k}_total_bytes"] = sum(op.size for op in ops)
            out[f"{k}_total_time"] = sum(op.time for op in ops)
        return out


# Transfer sizes in bytes: a 16 KiB block up to a 1 GiB batch.
SIZE_BUCKETS = tuple(float(2**p) for p in range(14, 31, 2))
TIER_COUNTERS = (
    "hits",
    "misses",
    "evictions",
    "errors",
    "written_through",
    "through_dropped",
    "suspensions",
)
TIER_GAUGES = ("used_blocks", "capacity_blocks", "through_queued")
# Moving load costs per tier (`tiercache.costs`), and the engine's forward.
TIER_COST_GAUGES = {
    "load_latency_ms": "Fixed part of a load job from the tier, ms (moving fit)",
    "load_mb_per_s": "Load rate from the tier beyond the fixed part, MB/s (moving fit)",
}
ENGINE_GAUGES = {
    "prefill_tokens_per_s": "Engine forward: marginal tokens per second (moving fit)",
    "step_overhead_ms": "Engine forward: fixed part of a step, ms (moving fit)",
}


class PrometheusMetrics:
    """Transfer and tier metrics in their own `CollectorRegistry`."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        namespace: str = "tiercache",
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labels = dict(labels or {})
        names = [*self._labels, "transfer_type"]
        ns, reg = namespace, self.registry
        self.transfer_bytes = Counter(
            f"{ns}_transfer_bytes", "Bytes moved by KV transfers", names, registry=reg
        )
        self.transfer_time = Counter(
            f"{ns}_transfer_time_seconds", "Seconds spent in KV transfers", names, registry=reg
        )
        self.transfer_size = Histogram(
            f"{ns}_transfer_size_bytes",
            "Size of KV transfers, in bytes",
            names,
            buckets=SIZE_BUCKETS,
            registry=reg,
        )
        tier_names = [*self._labels, "tier"]
        gauges = {g: f"Blocks: {g.replace('_', ' ')}" for g in TIER_GAUGES} | TIER_COST_GAUGES
        self.tier_gauges = {
            g: Gauge(f"{ns}_tier_{g}", doc, tier_names, registry=reg) for g, doc in gauges.items()
        }
        self.engine_gauges = {
            g: Gauge(f"{ns}_engine_{g}", doc, list(self._labels), registry=reg)
            for g, doc in ENGINE_GAUGES.items()
        }
        self.tier_counters = {
            c: Counter(f"{ns}_tier_{c}", f"Block {c} per tier", tier_names, registry=reg)
            for c in TIER_COUNTERS
        }
        self._last: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def observe(self, stats: TransferStats | Mapping[str, Sequence[TransferOp]]) -> None:
        """Add an interval's transfer operations (a `TransferStats` or its `data`)."""
        data = stats.data if isinstance(stats, TransferStats) else stats
        base = list(self._labels.values())
        metrics = (self.transfer_bytes, self.transfer_time, self.transfer_size)
        for key, ops in data.items():
            nbytes, secs, hist = (m.labels(*base, key) for m in metrics)
            for op in ops:
                nbytes.inc(op.size)
                secs.inc(op.time)
                hist.observe(op.size)

    def observe_tiers(self, tier_stats: Mapping[str, Mapping[str, Any]]) -> None:
        """Set tier gauges and advance tier counters from cumulative per-tier stats (a counter
        that went backwards, e.g. a reopened cache, counts from zero again)."""
        base = list(self._labels.values())
        with self._lock:
            for tier, st in tier_stats.items():
                values = [*base, tier]
                for g, gauge in self.tier_gauges.items():
                    if g in st:
                        gauge.labels(*values).set(st[g])
                for c, counter in self.tier_counters.items():
                    if c not in st:
                        continue
                    now = int(st[c])
                    last = self._last.get((tier, c), 0)
                    delta = now - last if now >= last else now
                    self._last[(tier, c)] = now
                    child = counter.labels(*values)  # the series exists from the start
                    if delta:
                        child.inc(delta)

    def observe_engine(self, engine: Mapping[str, Any]) -> None:
        """Set the engine gauges from `LoadCosts.engine_stats()` (missing keys: left as is)."""
        base = list(self._labels.values())
        for g, gauge in self.engine_gauges.items():
            if g in engine:
                (gauge.labels(*base) if base else gauge).set(engine[g])

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)

    def start_http_server(
        self, port: int, addr: str = "127.0.0.1"
    ) -> tuple[WSGIServer, threading.Thread]:
        """Serve the registry on `addr:port` (port 0: any free port, see `server.server_port`)
        from a daemon thread. Stop it with `server.shutdown(); server.server_close();
        thread.join()`."""
        return _start_http_server(port, addr=addr, registry=self.registry)
