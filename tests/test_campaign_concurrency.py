"""Concurrency campaign: processes sharing one LMDB tier (one writer and readers, then
writers taking turns with readers alongside) for a bounded time, and the in-process transfer
worker with many concurrent jobs over CPU, NVMe and LMDB tiers. No wrong bytes, no deadlock
(every child and job finishes within its bound), no lock or LMDB error reaching the caller,
and a fresh process finds the store clean afterwards.

Bounded here (TIERCACHE_CONCURRENCY_SECONDS, default 2 s per phase; TIERCACHE_TRANSFER_JOBS,
default 600 jobs); `-m stress`: 20 s per phase and 6,000 jobs.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.campaign_children import check_store, lmdb_reader, lmdb_writer
from tests.campaign_support import report, run_child, scale, start_child
from tests.ledger import Ledger, summary
from tests.test_transfer_common import make_kv, snapshot
from tiercache.tiers.cpu import CPUTier
from tiercache.tiers.lmdb import LMDBTier
from tiercache.tiers.nvme import NVMeTier
from tiercache.transfer import GPULoadStoreSpec, KVLayout, TierLoadStoreSpec, build_worker

BB, CAP, IDS = 32 * 1024, 32, 96


def lmdb_campaign(tmp_path: Path, seconds: float) -> dict:
    path = str(tmp_path / "shared")
    log = str(tmp_path / "ledger.log")  # every writer's acknowledged writes and frees
    bound = 60 + 3 * seconds
    # Phase 1: one writer, three readers, all at once (they may even create the store
    # together).
    writer = start_child(lmdb_writer, path, BB, CAP, IDS, seconds, 1, None, log)
    readers = [start_child(lmdb_reader, path, BB, CAP, IDS, seconds, 10 + r) for r in range(3)]
    w1 = writer.result(bound)
    r1 = [r.result(bound) for r in readers]
    # Phase 2: three writers taking turns (an flock per session), two readers throughout.
    turn = str(tmp_path / "turn.lock")
    writers = [
        start_child(lmdb_writer, path, BB, CAP, IDS, seconds, 20 + w, turn, log) for w in range(3)
    ]
    readers = [start_child(lmdb_reader, path, BB, CAP, IDS, seconds, 30 + r) for r in range(2)]
    w2 = [w.result(bound) for w in writers]
    r2 = [r.result(bound) for r in readers]
    final = run_child(check_store, "lmdb", path, BB, CAP, {"compression": "zstd"})
    # Block by block: every acknowledged write the writers did not free since is in the
    # store with its bytes (`tests.ledger`: present, evicted, lost, wrong by key).
    ledger = Ledger(persistent=frozenset({"lmdb"}))
    ledger.replay(log)
    sets = ledger.check(final["good"], final["wrong"])
    reads = r1 + r2
    figures = dict(
        seconds_per_phase=seconds,
        write_batches=w1["batches"] + sum(w["batches"] for w in w2),
        failed_stores=w1["failures"] + sum(w["failures"] for w in w2),
        writer_sessions=w1["sessions"] + sum(w["sessions"] for w in w2),
        reads_hit=sum(r["hits"] for r in reads),
        reads_missed=sum(r["misses"] for r in reads),
        wrong=sum(r["wrong"] for r in reads) + len(final["wrong"]),
        final_blocks=len(final["good"]),
        final_failed=len(final["failed"]),
        acknowledged=summary(sets),
    )
    assert figures["wrong"] == 0 and figures["final_failed"] == 0, figures
    assert not sets["lost"] and not sets["wrong"], {k: sorted(v) for k, v in sets.items()}
    assert sets["present"] and not sets["volatile"], figures  # one persistent tier, no kill
    # A store fails only with a full map: the map has room for the capacity plus headroom,
    # and a reader of another process that stays inside one read txn (descheduled on a
    # loaded machine) pins the pages freed meanwhile longer than a writer waits for it
    # (~255 ms, `tiers/lmdb/tier.py`). README guarantees 5 and 9: any other failure, or more than
    # 1 % of stores, fails the campaign. The failed store is counted, its blocks are misses.
    other = [f for w in [w1, *w2] for f in w["other_failures"]]
    assert other == [], other
    attempts = figures["write_batches"] + figures["failed_stores"]
    assert figures["failed_stores"] * 100 <= attempts, figures
    assert sum(r["hits"] for r in reads) > 0 and all(r["hits"] + r["misses"] for r in reads)
    # The writers really took turns (flock is not fair: under load one may get fewer).
    assert sum(1 for w in w2 if w["sessions"]) >= 2 and sum(w["sessions"] for w in w2) >= 3, w2
    assert 0 < figures["final_blocks"] <= CAP
    return report("concurrency", setup="lmdb, processes", **figures)


def test_lmdb_processes(tmp_path) -> None:
    lmdb_campaign(tmp_path, float(scale("concurrency_seconds", 2)))


@pytest.mark.stress
def test_lmdb_processes_long(tmp_path) -> None:
    lmdb_campaign(tmp_path, float(scale("concurrency_seconds", 20)))


# -- the in-process transfer worker -------------------------------------------------------------
def transfer_campaign(tmp_path: Path, jobs: int, seed: int) -> dict:
    """Many jobs in flight at once between the engine buffer and three tiers, in seeded
    random order; a model applies each job in submission order (the worker's contract), and
    at the end the engine buffer and every tier slot hold what the model says."""
    nb = 48
    caches, kv_first = make_kv("separate", nb, seed=seed)
    layout = KVLayout(caches, nb)
    bb = layout.block_bytes
    tiers = [
        CPUTier(block_bytes=bb, capacity_blocks=16),
        NVMeTier(path=str(tmp_path / "nvme"), block_bytes=bb, capacity_blocks=16, fsync="never"),
        LMDBTier(path=str(tmp_path / "lmdb"), block_bytes=bb, capacity_blocks=16),
    ]
    names = [t.medium for t in tiers]
    # The model: what each engine block and each tier slot holds, as engine block snapshots.
    engine = {b: snapshot(caches, kv_first, [b])[0] for b in range(nb)}
    slots: list[dict[int, list[torch.Tensor]]] = [{}, {}, {}]
    keys: list[dict[int, bytes]] = [{}, {}, {}]
    rnd = random.Random(seed)
    worker = build_worker(layout, tiers, disk_threads=3)
    results: dict[int, object] = {}
    n_store = n_load = n_move = 0
    try:
        for job in range(jobs):
            kind = rnd.random()
            t = rnd.randrange(3)
            n = rnd.randint(1, 4)
            ss = rnd.sample(range(16), n)
            if kind < 0.4 or not slots[t]:  # engine -> tier
                ids = rnd.sample(range(nb), n)
                ks = [job.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(n)]
                spec = (GPULoadStoreSpec(ids), TierLoadStoreSpec(t, names[t], ss, ks))
                for s, b, k in zip(ss, ids, ks, strict=True):
                    slots[t][s], keys[t][s] = engine[b], k
                n_store += 1
            else:
                full = sorted(slots[t])
                src = rnd.sample(full, min(n, len(full)))
                ks = [keys[t][s] for s in src]
                if kind < 0.75:  # tier -> engine
                    ids = rnd.sample(range(nb), len(src))
                    spec = (TierLoadStoreSpec(t, names[t], src, ks), GPULoadStoreSpec(ids))
                    for s, b in zip(src, ids, strict=True):
                        engine[b] = slots[t][s]
                    n_load += 1
                else:  # tier -> another tier
                    d = rnd.choice([x for x in range(3) if x != t])
                    dst = rnd.sample(range(16), len(src))
                    # Fresh keys at the destination: a key lives in one slot per tier (the
                    # manager's invariant; the LMDB tier addresses blocks by key).
                    dks = [job.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(len(dst))]
                    spec = (
                        TierLoadStoreSpec(t, names[t], src, ks),
                        TierLoadStoreSpec(d, names[d], dst, dks),
                    )
                    moved = [slots[t][s] for s in src]
                    for s, blk, k in zip(dst, moved, dks, strict=True):
                        slots[d][s], keys[d][s] = blk, k
                    n_move += 1
            assert worker.transfer_async(job, spec)
            if rnd.random() < 0.1:  # collect now and then, as an engine step would
                for r in worker.get_finished():
                    results[r.job_id] = r
        worker.wait(range(jobs))
        for r in worker.get_finished():
            results[r.job_id] = r
    finally:
        worker.close()
    try:
        assert len(results) == jobs, f"{jobs - len(results)} jobs never finished"
        failed = [j for j, r in results.items() if not r.success]
        # The engine buffer holds exactly what the model says...
        wrong: list[str] = []
        for b in range(nb):
            got = snapshot(caches, kv_first, [b])[0]
            if not all(
                torch.equal(g.view(torch.uint8), w.view(torch.uint8))
                for g, w in zip(got, engine[b], strict=True)
            ):
                wrong.append(f"engine block {b}")
        # ... and so does every tier slot (read back through the tier).
        checked = 0
        for t, tier in enumerate(tiers):
            for s, want in slots[t].items():
                out = torch.empty((1, bb), dtype=torch.uint8)
                assert tier.read([s], out, [keys[t][s]]) == []
                want_bytes = torch.cat([w.reshape(-1).view(torch.uint8) for w in want])
                if not torch.equal(out[0], want_bytes):
                    wrong.append(f"tier {names[t]} slot {s}")
                checked += 1
    finally:
        for tier in tiers:
            tier.close()
    figures = report(
        "concurrency",
        setup="transfer worker, cpu + nvme + lmdb",
        jobs=jobs,
        stores=n_store,
        loads=n_load,
        moves=n_move,
        slots_checked=checked,
        failed_jobs=len(failed),
        wrong=len(wrong),
    )
    assert not failed, f"jobs failed: {failed[:10]}"
    assert not wrong, f"{len(wrong)} blocks differ from the model: {wrong[:10]}"
    return figures


def test_transfer_worker_many_jobs(tmp_path) -> None:
    transfer_campaign(tmp_path, scale("transfer_jobs", 600), seed=5)


@pytest.mark.stress
def test_transfer_worker_many_jobs_long(tmp_path) -> None:
    transfer_campaign(tmp_path, scale("transfer_jobs", 6000), seed=2026)
