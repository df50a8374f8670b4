"""TransferStats (vLLM's OffloadingConnectorStats semantics) and the Prometheus metrics."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.test_transfer_common import new_threads
from tiercache import TierCache
from tiercache.transfer import PrometheusMetrics, TransferOp, TransferStats


def samples(metrics: PrometheusMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(metrics.exposition().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_record_reduce_is_empty_reset() -> None:
    st = TransferStats()
    assert st.is_empty() and st.reduce() == {}
    st.record_transfer(100, 0.5, ("GPU", "cpu"))
    st.record_transfer(50, 0.25, ("GPU", "cpu"))
    st.record_transfer(7, 1.0, "cpu_to_nvme")  # an already-keyed type
    assert not st.is_empty()
    assert st.reduce() == {
        "GPU_to_cpu_total_bytes": 150,
        "GPU_to_cpu_total_time": 0.75,
        "cpu_to_nvme_total_bytes": 7,
        "cpu_to_nvme_total_time": 1.0,
    }
    st.reset()
    assert st.is_empty()


def test_aggregate_adds_without_aliasing() -> None:
    a, b = TransferStats(), TransferStats()
    a.record_transfer(1, 0.1, ("GPU", "cpu"))
    b.record_transfer(2, 0.2, ("GPU", "cpu"))
    b.record_transfer(3, 0.3, ("cpu", "GPU"))
    assert a.aggregate(b) is a
    assert a.reduce()["GPU_to_cpu_total_bytes"] == 3 and a.reduce()["cpu_to_GPU_total_bytes"] == 3
    a.record_transfer(10, 1.0, ("cpu", "GPU"))
    assert b.data["cpu_to_GPU"] == [TransferOp(3, 0.3)]  # other is unchanged
    assert a.aggregate(TransferStats()).reduce() == a.reduce()  # empty adds nothing


def test_prometheus_transfer_metrics_labelled_by_type() -> None:
    m = PrometheusMetrics()
    st = TransferStats()
    st.record_transfer(2**20, 0.5, ("GPU", "cpu"))
    st.record_transfer(2**20, 0.25, ("GPU", "cpu"))
    st.record_transfer(4096, 0.1, ("cpu", "nvme"))
    m.observe(st)
    text = m.exposition().decode()
    assert 'tiercache_transfer_bytes_total{transfer_type="GPU_to_cpu"} 2.097152e+06' in text
    s = samples(m)
    assert s[("tiercache_transfer_time_seconds_total", (("transfer_type", "GPU_to_cpu"),))] == 0.75
    assert s[("tiercache_transfer_size_bytes_count", (("transfer_type", "cpu_to_nvme"),))] == 1
    assert (
        s[
            (
                "tiercache_transfer_size_bytes_bucket",
                (("le", "1.048576e+06"), ("transfer_type", "GPU_to_cpu")),
            )
        ]
        == 2
    )
    # A second instance has its own registry: no duplicate-metric error, separate values.
    other = PrometheusMetrics(labels={"engine": "1"})
    other.observe(st.data)
    assert (
        "tiercache_transfer_bytes_total",
        (("engine", "1"), ("transfer_type", "cpu_to_nvme")),
    ) in samples(other)
    assert s[("tiercache_transfer_bytes_total", (("transfer_type", "cpu_to_nvme"),))] == 4096


def test_prometheus_tier_metrics_from_cache_stats() -> None:
    m = PrometheusMetrics()
    cfg = {"block_size": 4, "namespace": "ns", "tiers": [{"kind": "cpu", "blocks": 2}]}
    with TierCache.open(cfg, block_bytes=64) as cache:
        keys = cache.hash_tokens(list(range(12)))  # 3 blocks into a 2-block tier: 1 eviction
        cache.put(keys[:2], torch.zeros((2, 64), dtype=torch.uint8))
        cache.put(keys[2:], torch.zeros((1, 64), dtype=torch.uint8))
        cache.lookup(keys)
        m.observe_tiers(cache.stats())
        s1 = samples(m)
        cache.lookup(keys)
        m.observe_tiers(cache.stats())
        s2 = samples(m)
    tier = (("tier", "cpu"),)
    assert s1[("tiercache_tier_capacity_blocks", tier)] == 2
    assert s1[("tiercache_tier_used_blocks", tier)] == 2
    assert s1[("tiercache_tier_evictions_total", tier)] == 1
    assert s1[("tiercache_tier_errors_total", tier)] == 0
    # Counters advance by the difference between snapshots, not by the running total.
    assert s2[("tiercache_tier_misses_total", tier)] > s1[("tiercache_tier_misses_total", tier)]
    assert s2[("tiercache_tier_hits_total", tier)] == 2 * s1[("tiercache_tier_hits_total", tier)]
    # A reset source (a reopened cache) counts from zero again instead of going backwards.
    m.observe_tiers({"cpu": {"hits": 1}})
    assert (
        samples(m)[("tiercache_tier_hits_total", tier)]
        == s2[("tiercache_tier_hits_total", tier)] + 1
    )


def test_prometheus_write_through_metrics(tmp_path) -> None:
    # cpu -> nvme: NVMe is written through by default; its copies and queue are exported.
    m = PrometheusMetrics()
    cfg = {
        "block_size": 4,
        "namespace": "ns",
        "tiers": [
            {"kind": "cpu", "blocks": 8},
            {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 8},
        ],
    }
    with TierCache.open(cfg, block_bytes=64) as cache:
        keys = cache.hash_tokens(list(range(12)))
        cache.put(keys, torch.zeros((3, 64), dtype=torch.uint8))
        cache.flush()  # runs what the write-through thread has not copied yet
        m.observe_tiers(cache.stats())
    s = samples(m)
    nvme = (("tier", "nvme"),)
    assert s[("tiercache_tier_written_through_total", nvme)] == 3
    assert s[("tiercache_tier_through_dropped_total", nvme)] == 0
    assert s[("tiercache_tier_through_queued", nvme)] == 0


def test_http_server_serves_and_stops() -> None:
    m = PrometheusMetrics()
    m.observe({"GPU_to_cpu": [TransferOp(10, 0.1)]})
    server, thread = m.start_http_server(0)
    try:
        port = server.server_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b'tiercache_transfer_bytes_total{transfer_type="GPU_to_cpu"} 10.0' in body
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert not thread.is_alive() and not new_threads()


@pytest.mark.parametrize("bad", [{"cpu": {"hits": "x"}}])
def test_observe_tiers_rejects_non_numbers(bad) -> None:
    with pytest.raises(ValueError):
        PrometheusMetrics().observe_tiers(bad)
