"""The bench's vLLM baseline drives vLLM's own `CPUOffloadingManager` as vLLM 0.32's
OffloadingConnector scheduler does (issue 14, item 9); this runs where CI installs vLLM.

What the 0.32 scheduler calls, per request (read from vllm/distributed/kv_transfer/
kv_connector/v1/offloading/scheduler.py): `on_new_request`; `lookup` key by key from the
first block not computed, stopping at the first MISS; `prepare_load` of the hit (which
records the access) and `complete_load` when its job is done; `prepare_store` of the blocks
it computed and `complete_store` when their job is done; `on_request_finished`, where the
manager applies the request's accesses to its policy (recency for LRU, frequency and the
adaptation of p for ARC). It never calls `touch`: recency is request-scoped in 0.32.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from tiercache.benchharness.replay import replay_manager, replay_vllm
from tiercache.benchharness.traces import make_trace


def test_vllm_manager_replay_runs_and_agrees_on_lru() -> None:
    t = make_trace("rag", 60)
    ours = replay_manager(t, "lru", 500)
    theirs = replay_vllm(t, "lru", 500)
    assert theirs is not None and theirs.ops == ours.ops
    # Both are LRU over the same chains: their hit rates should be close.
    assert abs(theirs.hit_rate - ours.hit_rate) < 0.02


def test_replay_calls_the_manager_as_the_scheduler_does(monkeypatch) -> None:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    calls: list[tuple[str, int]] = []
    for name in (
        "on_new_request",
        "lookup",
        "prepare_load",
        "complete_load",
        "prepare_store",
        "complete_store",
        "on_request_finished",
        "touch",
    ):
        real = getattr(CPUOffloadingManager, name)

        def rec(self: Any, *a: Any, _n: str = name, _r: Any = real, **kw: Any) -> Any:
            keys = a[0] if a and isinstance(a[0], list | tuple | set) else ()
            calls.append((_n, len(keys)))
            return _r(self, *a, **kw)

        monkeypatch.setattr(CPUOffloadingManager, name, rec)
    trace = make_trace("chat", 30)
    run = replay_vllm(trace, "arc", 200)
    assert run is not None
    # Split the calls per request and check each one's order.
    requests: list[list[tuple[str, int]]] = []
    for c in calls:
        if c[0] == "on_new_request":
            requests.append([])
        requests[-1].append(c)
    assert len(requests) == len(trace.requests)
    for req, keys in zip(requests, trace.requests, strict=True):
        names = [n for n, _ in req]
        assert names[0] == "on_new_request" and names[-1] == "on_request_finished"
        assert "touch" not in names  # the scheduler never touches; finishing applies recency
        lookups = names.count("lookup")
        hit = dict(req).get("prepare_load", 0)
        assert lookups == min(len(keys), hit + 1)  # stops at the first miss
        body = [n for n in names[1:-1] if n != "lookup"]
        expect = (["prepare_load", "complete_load"] if hit else []) + (
            ["prepare_store", "complete_store"] if hit < len(keys) else []
        )
        assert body == expect or body == expect[:-1]  # a refused store completes nothing
