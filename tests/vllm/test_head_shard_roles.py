"""Head shards through the KV connector's worker role, with real tensors and a real LMDB store
(no engine): what TP=2 ranks store, a TP=1 worker loads, and the other way round; a block
with a shard missing is a miss for the whole block. The engine-level tests are in
test_tp_layout.py; the mapping itself in tests/test_head_shards.py."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from tiercache.connectors.namespace import resolve_config
from tiercache.connectors.ranks import with_nvme_siblings
from tiercache.connectors.stores import SharedStore, acquire_store, release_store
from tiercache.connectors.vllm import TierCacheConnectorMetadata
from tiercache.connectors.vllm_kv import KVSettings, KVWorker, LoadJob, StoreJob
from tiercache.hashing import prefix_hashes
from tiercache.transfer.head_shards import HeadShards

L, NB, H, BS, HS = 2, 8, 4, 4, 8  # layers, engine blocks, KV heads, tokens/block, head size
SHARDS = 4  # one head per shard: TP 1, 2 and 4 can read it
N = 5  # blocks stored


def _engine(tp: int, fill: torch.Tensor | None = None, rank: int = 0) -> dict[str, torch.Tensor]:
    """vLLM CPU's layout for one rank: one allocation [L, NB, H/tp, BS, 2*HS], a layer each."""
    h = H // tp
    alloc = torch.zeros((L, NB, h, BS, 2 * HS), dtype=torch.float32)
    if fill is not None:
        alloc.copy_(fill[:, :, rank * h : (rank + 1) * h])
    return {f"model.layers.{i}.self_attn": alloc[i] for i in range(L)}


def _settings(root: Path, tp: int, rank: int) -> KVSettings:
    """Rank `rank` of `tp`: CPU + LMDB at `root`, or, where `root` is named ``nvme``, CPU +
    NVMe as the connector resolves it under head shards (instance `rank` with TP > 1, and
    the other instances read-only: `with_nvme_siblings`)."""
    lower: dict[str, Any] = {"kind": "lmdb", "path": str(root), "blocks": 64}
    if root.name == "nvme":
        lower = {"kind": "nvme", "path": str(root), "blocks": 64}
        if tp > 1:
            lower["instance"] = rank
    user = with_nvme_siblings({"tiers": [{"kind": "cpu", "blocks": 4}, lower]})
    shards = HeadShards(SHARDS, tp, rank)
    engine_bytes = (H // tp) * BS * 2 * HS * 4 * L
    config = resolve_config(user, block_size=BS, namespace="heads-roles")
    return KVSettings(
        config,
        block_size=BS,
        block_bytes=engine_bytes // shards.local,
        num_blocks=NB,
        tp_size=tp,
        tp_rank=rank,
        shards=shards,
        engine_block_bytes=engine_bytes,
        kv_heads=H // tp,
    )


def _workers(
    root: Path, tp: int, kv: list[dict[str, torch.Tensor]]
) -> tuple[list[KVWorker], SharedStore]:
    """One worker per rank. In an engine each is a process of its own; here they share this
    process's store (an LMDB environment opens once per process) and their keys are
    disjoint."""
    settings = [_settings(root, tp, r) for r in range(tp)]
    workers = []
    for s, caches in zip(settings, kv, strict=True):
        w = KVWorker(s, acquire_store(s.config, s.block_bytes))
        w.register_kv_caches(caches)
        workers.append(w)
    return workers, acquire_store(settings[0].config, settings[0].block_bytes)


def _done(workers: list[KVWorker]) -> None:
    deadline = time.monotonic() + 30
    while any(w._fl for w in workers):
        assert time.monotonic() < deadline, "transfers did not finish"
        for w in workers:
            w._drain()
        time.sleep(0.01)


def _close(workers: list[KVWorker], shared: SharedStore) -> None:
    for w in workers:
        w.shutdown()
    release_store(shared)  # the last reference: the CPU tier's blocks written back to LMDB


def _store(
    root: Path, tp: int, ref: torch.Tensor, keys: list[bytes], ids: tuple[int, ...]
) -> dict[str, Any]:
    kv = [_engine(tp, ref, r) for r in range(tp)]
    workers, shared = _workers(root, tp, kv)
    try:
        for w in workers:
            w.wait_for_save(TierCacheConnectorMetadata(stores=[StoreJob("r", tuple(keys), ids)]))
        _done(workers)
        total: dict[str, Any] = {}
        for w in workers:
            for k, v in w.take_stats().items():
                total[k] = total.get(k, 0) + v
        return total
    finally:
        _close(workers, shared)


def _load(
    root: Path, tp: int, keys: list[bytes], ids: tuple[int, ...]
) -> tuple[list[dict[str, torch.Tensor]], set[int]]:
    kv = [_engine(tp) for _ in range(tp)]
    workers, shared = _workers(root, tp, kv)
    try:
        errors: set[int] = set()
        for w in workers:
            w.start_load_kv(
                TierCacheConnectorMetadata(loads=[LoadJob("r", tuple(keys), ids, remote=True)])
            )
        _done(workers)
        for w in workers:
            errors |= w.get_block_ids_with_load_errors()
        return kv, errors
    finally:
        _close(workers, shared)


def _whole(kv: list[dict[str, torch.Tensor]], tp: int) -> torch.Tensor:
    """The ranks' caches put back together by heads: [L, NB, H, BS, 2*HS]."""
    per_rank = [torch.stack(list(caches.values())) for caches in kv]
    return torch.cat(per_rank, dim=2) if tp > 1 else per_rank[0]


@pytest.mark.parametrize(
    ("store_tp", "load_tp", "tier"),
    [
        (2, 1, "lmdb"),
        (1, 2, "lmdb"),
        (4, 2, "lmdb"),
        (2, 2, "lmdb"),
        (2, 1, "nvme"),
        (1, 2, "nvme"),
    ],
)
def test_what_one_tp_size_stores_another_loads(
    tmp_path: Path, store_tp: int, load_tp: int, tier: str
) -> None:
    """Through LMDB (one store), and through NVMe alone: each rank writes its own instance
    and reads the others' read-only (TP 1 -> 2: rank 1's shards in instance 0, rank 0's;
    TP 2 -> 1: shards 2..3 in instance 1)."""
    ref = torch.randn((L, NB, H, BS, 2 * HS), generator=torch.Generator().manual_seed(7))
    keys = prefix_hashes(list(range(N * BS)), BS, namespace="heads-roles")
    src = (1, 2, 3, 4, 5)
    stats = _store(tmp_path / tier, store_tp, ref, keys, src)
    assert stats.get("stored_blocks") == N * store_tp, stats  # each rank counts its blocks
    dst = (7, 0, 6, 2, 3)
    kv, errors = _load(tmp_path / tier, load_tp, keys, dst)
    assert errors == set()
    got = _whole(kv, load_tp)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(got[:, d], ref[:, s]), (s, d)
    untouched = [b for b in range(NB) if b not in dst]
    assert not got[:, untouched].any()


def test_a_block_missing_one_shard_is_a_miss_for_the_whole_block(tmp_path: Path) -> None:
    ref = torch.randn((L, NB, H, BS, 2 * HS), generator=torch.Generator().manual_seed(8))
    keys = prefix_hashes(list(range(N * BS)), BS, namespace="heads-roles")
    src = (1, 2, 3, 4, 5)
    # TP=2: rank 0 stores its shards of all 5 blocks, rank 1 of the first 2 only (its other
    # stores lost, say).
    kv = [_engine(2, ref, r) for r in range(2)]
    workers, shared = _workers(tmp_path / "lmdb", 2, kv)
    try:
        for w, n in zip(workers, (N, 2), strict=True):
            job = StoreJob("r", tuple(keys[:n]), src[:n])
            w.wait_for_save(TierCacheConnectorMetadata(stores=[job]))
        _done(workers)
    finally:
        _close(workers, shared)
    # TP=1 owns every shard: blocks 2.. lack rank 1's and are misses, whole: recomputed,
    # and not one byte of them written into the engine.
    dst = (7, 0, 6, 2, 3)
    kv, errors = _load(tmp_path / "lmdb", 1, keys, dst)
    assert errors == {6, 2, 3}
    got = _whole(kv, 1)
    assert torch.equal(got[:, 7], ref[:, 1]) and torch.equal(got[:, 0], ref[:, 2])
    assert not got[:, [6, 2, 3]].any()


def test_the_scheduler_counts_a_shard_where_its_owner_holds_it() -> None:
    """Remote placement: a shard is a hit where the rank that owns it holds it. A TP=1 store
    reopened by TP=2 ranks sits in rank 0's private NVMe whole, rank 1's shards too; the
    index counts them as rank 0's tier's: no hits by the index alone (rank 1 reads them
    through its siblings tier, and the scheduler finds them with the siblings probe: the
    next test)."""
    from tiercache.connectors.vllm_kv.remote_index import RemoteIndex

    shards = HeadShards(SHARDS, 2, 0)  # the scheduler's view: 2 shards per rank
    a, b = prefix_hashes(list(range(2 * BS)), BS, namespace="heads-roles")
    look = shards.all_keys([a, b])  # a's shards 0..3, then b's

    def index() -> RemoteIndex:
        return RemoteIndex(2, lambda *args, **kw: None, None, None, shards)

    def blocks(idx: RemoteIndex) -> int:  # as the scheduler counts: whole blocks only
        return idx.lookup(look) // SHARDS

    idx = index()
    idx.apply(0, tuple(look), "NVMe", False)  # rank 0 recovered every shard of a and b
    assert blocks(idx) == 0
    idx.apply(1, tuple(look[2:4]), "CPU", False)  # rank 1 holds its own shards of a
    assert blocks(idx) == 1  # a whole, b not
    idx.apply(1, tuple(look[2:4]), "CPU", True)
    assert blocks(idx) == 0
    # Rank 0's shards count only as rank 0's: held by rank 1 alone they are no hits.
    other = index()
    other.apply(1, tuple(look), "CPU", False)
    assert other.lookup(look) == 0  # not even rank 0's first shard
    # Each rank holding its own: both blocks; the owner's tier suspended: none.
    idx.apply(1, tuple(look[2:4] + look[6:8]), "CPU", False)
    assert blocks(idx) == 2
    idx.suspend({"CPU": 60.0})
    assert blocks(idx) == 0


def test_the_scheduler_finds_a_ranks_shards_in_another_ranks_nvme_instance(
    tmp_path: Path,
) -> None:
    """TP 1 -> 2 on NVMe alone: instance 0 (rank 0's) holds every shard. The index counts
    rank 1's shards there as no hits (rank 0's tier), but the siblings probe, which reads
    every instance of the path read-only as rank 1's siblings tier does, finds them: whole
    blocks hit. A shard no instance holds ends the hit at its block."""
    from tiercache.connectors.vllm_kv.remote_index import RemoteIndex
    from tiercache.tiers.nvme.siblings import SiblingsProbe

    ref = torch.randn((L, NB, H, BS, 2 * HS), generator=torch.Generator().manual_seed(9))
    keys = prefix_hashes(list(range(N * BS)), BS, namespace="heads-roles")
    _store(tmp_path / "nvme", 1, ref, keys[:3], (1, 2, 3))  # TP=1: blocks 0..2, all shards
    shards = HeadShards(SHARDS, 2, 0)
    look = shards.all_keys(keys)
    bb = _settings(tmp_path / "nvme", 2, 0).block_bytes
    probe = SiblingsProbe(str(tmp_path / "nvme"), bb, "heads-roles")
    # Head shards: one set of probes for every rank (they share their paths).
    idx = RemoteIndex(2, lambda *a, **kw: None, [[("nvme-siblings", probe)]], None, shards)
    try:
        idx.apply(0, tuple(look[: 3 * SHARDS]), "nvme", False)  # rank 0 recovered them all
        deadline = time.monotonic() + 30
        while (n := idx.lookup(look, "r")) is None:
            assert time.monotonic() < deadline
        assert n == 3 * SHARDS  # blocks 0..2 whole; block 3 held nowhere
        # A same-TP engine's miss: no journal names the key, so the probe is not run (the
        # scheduler answers from memory, without waiting for the probe thread).
        asked: list[int] = []
        real = probe.probe
        probe.probe = lambda keys: asked.append(len(keys)) or real(keys)  # type: ignore[method-assign]
        assert idx.lookup(look[3 * SHARDS :], "s") == 0 and asked == []
        while (n := idx.lookup(look, "t")) is None:
            assert time.monotonic() < deadline
        assert n == 3 * SHARDS and asked  # keys a journal names: probed
    finally:
        idx.shutdown()
    bare = RemoteIndex(2, lambda *a, **kw: None, None, None, shards)
    bare.apply(0, tuple(look[: 3 * SHARDS]), "nvme", False)
    assert bare.lookup(look) == 2  # without the siblings: rank 0's first shards only
