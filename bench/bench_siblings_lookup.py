"""What NVMe siblings (tiers/nvme/siblings.py) cost a same-TP engine: lookup misses.

Under head shards each rank's cache has, below its NVMe tier, a read-only tier over the
path's other instances, and the scheduler a probe over all of them. A same-TP engine never
asks for the shards those instances hold (they are the other ranks'), so what it pays is on
a miss: the manager asks one more tier (`probe`: a dict lookup for the first missing key),
and the scheduler's index checks `may_hold` (a dict lookup) before it would start its probe
thread. This times both, with and without the siblings, on real NVMe files:

- worker: `TierCache.lookup` of a 64-key chain, the first 32 held in the CPU tier, the rest
  held nowhere (counting on, as an engine's lookups do); CPU + NVMe (instance 1), with and
  without the siblings tier over instance 0 holding `--blocks` other blocks;
- scheduler: `RemoteIndex.lookup` (TP=2, head shards) of 8 blocks' shards, the first 4
  blocks held by their owners per the index, the rest nowhere; no probes (CPU + NVMe
  before) and the siblings probe.

Prints one JSON line per run (µs per lookup: medians of `--reps` timings of `--n` calls),
then the medians over the runs.
Run: .venv-vllm/bin/python bench/bench_siblings_lookup.py --runs 5 (the scheduler half imports
vLLM)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tiercache import TierCache
from tiercache.connectors.ranks import with_nvme_siblings
from tiercache.tiers.nvme.siblings import SiblingsProbe
from tiercache.transfer.head_shards import HeadShards

BB = 4096


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _time(fn: Callable[[], object], n: int, reps: int) -> float:
    """Median over `reps` of the µs per call of `n` calls."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def _config(path: Path, siblings: bool) -> dict:
    nvme = {"kind": "nvme", "path": str(path), "blocks": 4096, "instance": 1}
    user = {"namespace": "bench", "tiers": [{"kind": "cpu", "blocks": 256}, nvme]}
    return with_nvme_siblings(user) if siblings else user


def worker(path: Path, siblings: bool, n: int, reps: int) -> float:
    c = TierCache.open(_config(path, siblings), block_bytes=BB)
    try:
        held = [_key(10_000_000 + i) for i in range(32)]
        c.put(held, torch.zeros((32, BB), dtype=torch.uint8))
        chain = held + [_key(20_000_000 + i) for i in range(32)]
        assert c.lookup(chain) == 32
        return _time(lambda: c.lookup(chain), n, reps)
    finally:
        c.close()


def scheduler(path: Path, siblings: bool, n: int, reps: int) -> float:
    from tiercache.connectors.vllm_kv.remote_index import RemoteIndex

    shards = HeadShards(4, 2, 0)
    look = shards.all_keys([_key(30_000_000 + i) for i in range(8)])
    probes = [[("nvme-siblings", SiblingsProbe(str(path), BB, "bench"))]] if siblings else None
    idx = RemoteIndex(2, lambda *a, **kw: None, probes, None, shards)
    try:
        for i, k in enumerate(look[:16]):
            idx.apply(shards.owner(i), (k,), "nvme", False)
        assert idx.lookup(look, "r") == 16
        return _time(lambda: idx.lookup(look, "r"), n, reps)
    finally:
        idx.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=4096, help="blocks in the sibling instance")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "nvme"
        owner = TierCache.open(
            {
                "namespace": "bench",
                "tiers": [{"kind": "nvme", "path": str(path), "blocks": a.blocks}],
            },
            block_bytes=BB,
        )
        try:
            keys = [_key(i) for i in range(a.blocks)]
            for i in range(0, a.blocks, 256):
                owner.put(
                    keys[i : i + 256], torch.ones((len(keys[i : i + 256]), BB), dtype=torch.uint8)
                )
        finally:
            owner.close()
        for run in range(a.runs):
            row = {
                "run": run,
                "worker_us": worker(path, False, a.n, a.reps),
                "worker_siblings_us": worker(path, True, a.n, a.reps),
                "scheduler_us": scheduler(path, False, a.n, a.reps),
                "scheduler_siblings_us": scheduler(path, True, a.n, a.reps),
            }
            rows.append(row)
            print(json.dumps({k: round(v, 2) for k, v in row.items()}), flush=True)
    med = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0] if k != "run"}
    print(json.dumps({"median": med}))


if __name__ == "__main__":
    main()
