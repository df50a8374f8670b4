"""Issue 35: with ``kv_load_failure_policy = "recompute"`` the KV connector's local placement
loads a hit held only in persistent tiers straight into the engine's blocks, asynchronously,
verified there (no verifying read into the first tier, no copy out of it); a block that fails
verification is a load error for exactly that block. With "fail" the scheduler still reads
and verifies such blocks before it reports them (test_kv_connector_parts.py). And in a step
without a forward, the worker's `get_finished` waits briefly for the oldest such load
instead of letting vLLM's loop spin (which starved the load's threads of the GIL)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.v1.request import Request

from tests.test_tier_nvme import flip, slot_of
from tiercache.connectors.namespace import resolve_config
from tiercache.connectors.stores import acquire_store, release_store
from tiercache.connectors.vllm import TierCacheConnectorMetadata
from tiercache.connectors.vllm_kv import IDLE_WAIT_S, KVScheduler, KVSettings, KVWorker
from tiercache.tiers import format as fmt

BS, BB = 4, 64  # tokens and bytes per block
TARGETS = [3, 4, 5, 6]  # the engine blocks vLLM allocates for the hit


def _setup(tmp_path: Path, *, recompute: bool) -> tuple[Any, KVScheduler, KVWorker, Any]:
    """A CPU tier of 2 blocks over NVMe (write-back), a 4-block chain put into it (the first
    two in the CPU tier, the last two in NVMe), and both roles on the store."""
    tiers = [
        {"kind": "cpu", "blocks": 2},
        {
            "kind": "nvme",
            "path": str(tmp_path / "nvme"),
            "blocks": 16,
            "write_policy": "write-back",
        },
    ]
    config = resolve_config({"tiers": tiers}, block_size=BS, namespace="direct")
    shared = acquire_store(config, BB)
    settings = KVSettings(config, BS, BB, num_blocks=8, recompute_failures=recompute)
    w, s = KVWorker(settings, shared), KVScheduler(settings, acquire_store(config, BB))
    engine = torch.zeros((8, BB), dtype=torch.uint8)
    w.register_kv_caches({"model.layers.0.attn": engine})
    cache = shared.cache
    tokens = list(range(4 * BS + 1))  # 4 whole blocks, and the token vLLM computes
    keys = cache.hash_tokens(tokens[: 4 * BS])
    rows = torch.stack([torch.full((BB,), 10 + i, dtype=torch.uint8) for i in range(4)])
    cache.put(keys, rows)
    assert [cache.manager.where(k) for k in keys] == [[0], [0], [1], [1]]
    req = Request("r", tokens, SamplingParams(max_tokens=1), None)
    return shared, s, w, SimpleNamespace(engine=engine, keys=keys, rows=rows, req=req)


def _alloc(s: KVScheduler, req: Request, tokens: int) -> Any:
    """vLLM's allocation of the hit's blocks; the load job it plans."""
    blocks = SimpleNamespace(get_block_ids=lambda: (TARGETS,))
    s.update_state_after_alloc(req, blocks, tokens)  # type: ignore[arg-type]
    (job,) = s._loads
    s._loads = []
    return job


def _step(w: KVWorker, job: Any, tokens: int = 0) -> tuple[set[str] | None, set[str] | None]:
    """One engine step computing `tokens` (0: none, every request waits for its load), as
    vLLM calls the worker: bind, start_load_kv, wait_for_save, get_finished."""
    meta = TierCacheConnectorMetadata(loads=[job] if job is not None else [], step_tokens=tokens)
    w.bind()
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    return w.get_finished(set())


def _received(w: KVWorker, job: Any) -> set[str] | None:
    """Steps without a forward, the first submitting `job`, until a load is reported
    received (at most 2,000 steps); what was."""
    recved = None
    for _ in range(2000):
        _, recved = _step(w, job)
        job = None
        if recved:
            break
    return recved


def _close(shared: Any, s: KVScheduler, w: KVWorker) -> None:
    w.shutdown()
    s.shutdown()
    release_store(shared)


def test_recompute_policy_loads_a_persistent_hit_straight_into_the_engine(tmp_path) -> None:
    shared, s, w, t = _setup(tmp_path, recompute=True)
    try:
        cache = shared.cache
        assert s.get_num_new_matched_tokens(t.req, 0) == (4 * BS, True)  # asynchronous
        assert "verified_blocks" not in s._stats  # nothing read at the lookup
        job = _alloc(s, t.req, 4 * BS)
        assert job.asynchronous and not job.remote and job.spec is not None  # pinned here
        assert _received(w, job) == {"r"}
        assert w.get_block_ids_with_load_errors() == set()
        assert torch.equal(t.engine[TARGETS], t.rows)
        # Read from NVMe into the engine only: nothing promoted into the CPU tier.
        assert [cache.manager.where(k) for k in t.keys] == [[0], [0], [1], [1]]
        assert cache.stats()["nvme"]["errors"] == 0
    finally:
        _close(shared, s, w)


def test_a_corrupt_block_is_a_load_error_for_exactly_that_block(tmp_path) -> None:
    shared, s, w, t = _setup(tmp_path, recompute=True)
    try:
        nvme = shared.cache.tiers[1]
        sb = json.loads((Path(nvme.path) / "meta.json").read_text())["slot_bytes"]
        flip(Path(nvme.path) / "slab", slot_of(Path(nvme.path), t.keys[2]) * sb + fmt.HEADER_SIZE)
        assert s.get_num_new_matched_tokens(t.req, 0) == (4 * BS, True)
        job = _alloc(s, t.req, 4 * BS)
        assert _received(w, job) == {"r"}
        assert w.get_block_ids_with_load_errors() == {TARGETS[2]}
        good = [0, 1, 3]
        assert torch.equal(t.engine[[TARGETS[i] for i in good]], t.rows[good])
        assert shared.cache.stats()["nvme"]["errors"] == 1
        # The bad block is out of the index: the next lookup ends before it, in the CPU tier
        # (a synchronous load from memory).
        req2 = Request("r2", list(t.req.prompt_token_ids), SamplingParams(max_tokens=1), None)
        assert s.get_num_new_matched_tokens(req2, 0) == (2 * BS, False)
    finally:
        _close(shared, s, w)


def test_fail_policy_still_verifies_before_it_reports(tmp_path) -> None:
    """With "fail" a load error would fail the request: the scheduler reads the NVMe blocks
    first (promoting them), and the load is synchronous, from memory."""
    shared, s, w, t = _setup(tmp_path, recompute=False)
    try:
        while (got := s.get_num_new_matched_tokens(t.req, 0))[0] is None:
            pass
        assert got == (4 * BS, False)
        assert s._stats["verified_blocks"] == 2
        job = _alloc(s, t.req, 4 * BS)
        assert not job.asynchronous
        w.bind()
        w.start_load_kv(TierCacheConnectorMetadata(loads=[job], step_tokens=1))
        assert torch.equal(t.engine[TARGETS], t.rows)
    finally:
        _close(shared, s, w)


def test_an_idle_step_waits_for_the_oldest_load_and_a_forward_step_does_not(
    tmp_path,
) -> None:
    shared, s, w, t = _setup(tmp_path, recompute=True)
    waits: list[tuple[list[int], float | None]] = []
    try:
        assert w._worker is not None
        real_wait = w._worker.wait

        def wait(job_ids: Any, timeout: float | None = None) -> set[int]:
            waits.append((list(job_ids), timeout))
            return real_wait(job_ids, timeout)

        w._worker.wait = wait  # type: ignore[method-assign]
        s.get_num_new_matched_tokens(t.req, 0)
        job = _alloc(s, t.req, 4 * BS)
        # A step with a forward (another request computes): no wait beyond the usual.
        _step(w, job, tokens=8)
        assert waits == []
        # Steps without a forward: each waits for the oldest load, at most IDLE_WAIT_S.
        assert _received(w, None) == {"r"}
        assert waits and all(len(ids) == 1 for ids, _ in waits)
        assert all(tm is not None and 0 <= tm <= IDLE_WAIT_S for _, tm in waits)
        assert torch.equal(t.engine[TARGETS], t.rows)
        # Nothing in flight: an idle step does not wait.
        n = len(waits)
        _step(w, None)
        assert len(waits) == n
    finally:
        _close(shared, s, w)
