"""The KV connector's two roles on one real store, driven as vLLM drives them for one prefill
step, for the event tests (test_kv_events.py, test_kv_events_shared.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from tiercache.connectors.namespace import resolve_config
from tiercache.connectors.stores import acquire_store, release_store
from tiercache.connectors.vllm_kv import KVScheduler, KVSettings, KVWorker

BS, BB = 4, 64
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def vllm_hashes(req: Request) -> list[Any]:
    """The request's vLLM block hashes as vLLM's events publish them (ints by default)."""
    return [maybe_convert_block_hash(h) for h in req.block_hashes]


def request(req_id: str, tokens: list[int], **kw: Any) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, block_hasher=HASHER, **kw)


def roles(tiers: list[dict]) -> tuple[Any, KVScheduler, KVWorker]:
    config = resolve_config({"tiers": tiers}, block_size=BS, namespace="events")
    shared = acquire_store(config, BB)
    settings = KVSettings(config, BS, BB, num_blocks=16, events=True)
    return shared, KVScheduler(settings, acquire_store(config, BB)), KVWorker(settings, shared)


def serve(s: KVScheduler, w: KVWorker, shared: Any, req: Request) -> list[Any]:
    """One prefill step of `req` as vLLM drives the scheduler role; the worker's save stood in
    for by a put of the planned keys; then the worker's metadata back to the scheduler and
    the events vLLM would publish."""
    n = req.num_tokens
    tokens, _ = s.get_num_new_matched_tokens(req, 0)
    assert tokens == 0
    new = SimpleNamespace(req_id=req.request_id, block_ids=(list(range(1, n // BS + 2)),))
    new.num_computed_tokens = 0
    out = SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        ),
        num_scheduled_tokens={req.request_id: n},
        total_num_scheduled_tokens=n,
        preempted_req_ids=set(),
    )
    meta = s.build_connector_meta(out)  # type: ignore[arg-type]
    (job,) = meta.stores
    rows = torch.stack([torch.full((BB,), i, dtype=torch.uint8) for i in range(len(job.keys))])
    shared.cache.put(list(job.keys), rows)
    s.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=w.build_connector_worker_meta())
    )
    return list(s.take_events())


def close(shared: Any, s: KVScheduler, w: KVWorker) -> None:
    w.shutdown()
    s.shutdown()
    release_store(shared)
