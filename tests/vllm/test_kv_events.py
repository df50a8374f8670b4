"""Issue 51: the KV events the connector's scheduler role hands vLLM describe each block as
vLLM's prefix cache would (its block hashes, parent, tokens, block size, LoRA, extra keys),
per vLLM medium and locality, through the real path: the scheduler plans the store, the
blocks land in a real store (CPU over NVMe, or LMDB), the worker role drains the store's
events into its metadata, and the scheduler turns them into vLLM's events."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.lora.request import LoRARequest

from tests.vllm.event_roles import BS, close, request, roles, serve, vllm_hashes
from tiercache.connectors.vllm_kv.kv_events import LOCAL, SHARED


def _stored(events: list[Any]) -> dict[tuple[str, str], list[BlockStored]]:
    out: dict[tuple[str, str], list[BlockStored]] = {}
    for e in events:
        if isinstance(e, BlockStored):
            out.setdefault((e.medium, e.locality), []).append(e)
    return out


def test_stored_blocks_carry_vllms_hashes_tokens_and_parents(tmp_path: Path) -> None:
    tiers = [
        {"kind": "cpu", "blocks": 2},
        {
            "kind": "nvme",
            "path": str(tmp_path / "nvme"),
            "blocks": 16,
            "write_policy": "write-back",
        },
    ]
    shared, s, w = roles(tiers)
    try:
        tokens = list(range(100, 100 + 4 * BS + 1))
        req = request("a", tokens)
        events = serve(s, w, shared, req)
        # vLLM's own hashes of the same tokens, computed afresh (what a router computes).
        fresh = vllm_hashes(request("x", tokens))
        by = _stored(events)
        got = {e.block_hashes[0]: e for es in by.values() for e in es}
        assert sorted(got) == sorted(fresh[:4])  # every whole block, once
        for i, h in enumerate(fresh[:4]):
            e = got[h]
            assert e.parent_block_hash == (fresh[i - 1] if i else None)
            assert e.token_ids == tokens[i * BS : (i + 1) * BS]
            assert (e.block_size, e.lora_name, e.extra_keys) == (BS, None, None)
        # Two blocks in the CPU tier, two written around it into NVMe (see test_direct_loads).
        assert {m: len(v) for m, v in by.items()} == {("CPU", LOCAL): 2, ("STORAGE", LOCAL): 2}
        # A second prompt takes the CPU tier: its two blocks are demoted to NVMe, reported
        # removed from CPU and stored in STORAGE, with the same description.
        cpu_hashes = {e.block_hashes[0] for e in by[("CPU", LOCAL)]}
        events = serve(s, w, shared, request("b", list(range(500, 500 + 2 * BS + 1))))
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert {h for e in removed for h in e.block_hashes} == cpu_hashes
        assert all((e.medium, e.locality) == ("CPU", LOCAL) for e in removed)
        moved = {e.block_hashes[0] for e in _stored(events).get(("STORAGE", LOCAL), [])}
        assert cpu_hashes <= moved
        # A late subscriber's snapshot: every block where it is held now.
        snap = _stored(s._translator.snapshot())  # type: ignore[union-attr]
        assert {e.block_hashes[0] for e in snap[("STORAGE", LOCAL)]} >= set(fresh[:4])
    finally:
        close(shared, s, w)


def test_lora_and_cache_salt_are_reported_as_vllm_reports_them(tmp_path: Path) -> None:
    shared, s, w = roles([{"kind": "lmdb", "path": str(tmp_path / "db"), "blocks": 16}])
    try:
        tokens = list(range(7, 7 + 2 * BS + 1))
        lora = LoRARequest("adapter", 3, str(tmp_path / "adapter"))
        req = request("a", tokens, lora_request=lora, cache_salt="salt")
        events = serve(s, w, shared, req)
        by = _stored(events)
        assert list(by) == [("STORAGE", SHARED)]  # a store every engine on it reads
        first, second = sorted(
            by[("STORAGE", SHARED)], key=lambda e: e.parent_block_hash is not None
        )
        assert first.block_hashes == [vllm_hashes(req)[0]]
        assert second.parent_block_hash == vllm_hashes(req)[0]
        assert (first.lora_id, first.lora_name) == (3, "adapter")
        # vLLM's untagged per-block form: the LoRA name, and the salt on the first block only.
        assert first.extra_keys == [("adapter", "salt")]
        assert second.extra_keys == [("adapter",)]
        # Without the salt the hashes differ: the router cannot confuse the two.
        assert request("b", tokens, lora_request=lora).block_hashes[0] != req.block_hashes[0]
    finally:
        close(shared, s, w)


def test_blocks_found_in_a_store_are_reported_once_a_lookup_describes_them(tmp_path: Path) -> None:
    """A restarted engine finds its blocks in NVMe with no description: they are reported
    when a lookup hits them (the request in hand describes them), where they are held."""
    tiers = [{"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 16}]
    shared, s, w = roles(tiers)
    tokens = list(range(40, 40 + 3 * BS + 1))
    try:
        serve(s, w, shared, request("a", tokens))
    finally:
        close(shared, s, w)
    shared, s, w = roles(tiers)
    try:
        s.update_connector_output(
            SimpleNamespace(kv_connector_worker_meta=w.build_connector_worker_meta())
        )
        assert list(s.take_events()) == []  # held, but nothing describes them yet
        req = request("b", tokens)
        assert s.get_num_new_matched_tokens(req, 0)[0] == 3 * BS
        events = list(s.take_events())
        assert sorted(e.block_hashes[0] for e in events) == sorted(vllm_hashes(req)[:3])
        assert {(e.medium, e.locality) for e in events} == {("STORAGE", LOCAL)}
    finally:
        close(shared, s, w)
