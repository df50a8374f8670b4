"""First lookups after a lazy open of an LMDB store (issue 35), through the facade.

`fill PATH N`: a new store of N blocks of 4 KiB at PATH (the keys and bytes of
`bench_scale.py`), closed; kept for the runs that follow.
`run PATH N [--count C] [--rounds R] [--seed S]`: R times, each in a fresh process: drop the
page cache (all of it with `/proc/sys/vm/drop_caches` when root, else the store's files with
POSIX_FADV_DONTNEED), open the store (`TierCache.open`: lazy), wait for the index warm pass
(`tiers/lmdb/warm.py`) to finish, then time
- C single-key `lookup`s of random held keys, each its first since the open (the manager's
  discover and adopt path and the tier's `probe`): keys/s of wall time and of this thread's
  CPU time (`time.thread_time`, which a loaded machine inflates far less);
- the same C keys again (indexed now);
- 2,000 16-key chains at random places, most keys first lookups (keys/s, wall and CPU).
One JSON line per round, then the medians.

A/B: run the same command with the other tree's interpreter on the same store, interleaved.
Run: .venv/bin/python bench/bench_first_lookup.py fill /tmp/fl 1m
     .venv/bin/python bench/bench_first_lookup.py run /tmp/fl 1m --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scale as bs


def drop_cache(path: str) -> str:
    if os.geteuid() == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "all"
    bs.drop_cached(path)
    return "store files"


def child_run(path: str, n: int, count: int, seed: int) -> dict[str, Any]:
    from tiercache import TierCache

    t0 = time.perf_counter()
    cache = TierCache.open(bs.config("lmdb", path, n), block_bytes=4096)
    t1 = time.perf_counter()
    tier = cache.tiers[0]
    while "index_warm_pages" not in tier.stats() and time.perf_counter() - t1 < 60:
        time.sleep(0.05)  # the warm pass reports when it is done
    warm = {k: v for k, v in tier.stats().items() if k.startswith("index_warm")}
    rnd = random.Random(seed)
    keys = [bs.key(rnd.randrange(n)) for _ in range(count)]
    w0, c0 = time.perf_counter(), time.thread_time()
    hits = sum(cache.lookup([k]) for k in keys)
    w1, c1 = time.perf_counter(), time.thread_time()
    for k in keys:
        cache.lookup([k])
    w2 = time.perf_counter()
    chains = [
        [bs.key(i) for i in range(s, s + 16)] for s in (rnd.randrange(n - 16) for _ in range(2000))
    ]
    w3, c3 = time.perf_counter(), time.thread_time()
    chain_hits = sum(cache.lookup(c) for c in chains)
    w4, c4 = time.perf_counter(), time.thread_time()
    cache.close()
    k16 = 16 * len(chains)
    return {
        "open_s": round(t1 - t0, 3),
        "warm": warm,
        "first_1_per_s": round(count / (w1 - w0)),
        "first_1_per_cpu_s": round(count / (c1 - c0)),
        "hits": hits,
        "again_1_per_s": round(count / (w2 - w1)),
        "chain16_keys_per_s": round(k16 / (w4 - w3)),
        "chain16_keys_per_cpu_s": round(k16 / (c4 - c3)),
        "chain16_hits": chain_hits,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("fill", "run", "child"))
    p.add_argument("path")
    p.add_argument("blocks")
    p.add_argument("--count", type=int, default=20_000, help="single-key first lookups")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    n = bs.parse_size(a.blocks)
    if a.mode == "fill":
        print(json.dumps(bs.child_fill("lmdb", a.path, n, 4096, 256, False)))
        return
    if a.mode == "child":
        print(json.dumps(child_run(a.path, n, a.count, a.seed)), flush=True)
        return
    runs = []
    for r in range(a.rounds):
        dropped = drop_cache(a.path)
        cmd = [sys.executable, os.path.abspath(__file__), "child", a.path, str(n)]
        cmd += ["--count", str(a.count), "--seed", str(a.seed + r)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        res = json.loads(out.stdout.strip().splitlines()[-1])
        res.update(round=r + 1, dropped=dropped, load=round(os.getloadavg()[0], 2))
        runs.append(res)
        print(json.dumps(res), flush=True)
    names = ("first_1_per_s", "first_1_per_cpu_s", "again_1_per_s", "chain16_keys_per_s")
    med = {k: statistics.median(r[k] for r in runs) for k in (*names, "open_s")}
    print(json.dumps({"median": med}))


if __name__ == "__main__":
    main()
