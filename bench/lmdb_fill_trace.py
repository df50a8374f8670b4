"""Trace an LMDB fill through the facade (issue 35): where the time and the bytes go.

Fills a new store of N 4 KiB blocks as `bench_scale.py` does (same keys and bytes, batches
of 256 `put`s), or with `--raw` fills raw py-lmdb (default flags, 64 puts per write txn).
Every tenth it prints the rate over that tenth, the CPU the process used (cores), its
RssFile, and the bytes it read and wrote (`/proc/self/io` read_bytes / write_bytes: pages it
made dirty, so a page written back and dirtied again counts again). At the end: the disk's
own sectors written (`/proc/diskstats`, all processes) and run-queue wait
(`/proc/self/schedstat`: time spent runnable but waiting for a CPU).

`--open '{"readahead": true}'` overrides `lmdb.open` arguments of the tier, `--sync never`
sets its sync mode: how the causes in the README's issue-35 section were told apart.

Run: .venv/bin/python bench/lmdb_fill_trace.py 400k [--open JSON] [--sync MODE] [--raw]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import lmdb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_scale import config, key, parse_size, rows


def io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = int(v)
    return out


def rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


def disk_written(dev: str) -> int:
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return int(p[9]) * 512
    return 0


def sched() -> tuple[float, float]:
    with open("/proc/self/schedstat") as f:
        run, wait, _ = (int(x) for x in f.read().split())
    return run / 1e9, wait / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("blocks", type=parse_size)
    p.add_argument("--open", default="{}", help="lmdb.open overrides for the tier (JSON)")
    p.add_argument("--sync", default="batch")
    p.add_argument("--raw", action="store_true", help="raw py-lmdb instead of the tier")
    p.add_argument("--dir", default=None)
    p.add_argument("--dev", default="vda", help="the disk in /proc/diskstats")
    a = p.parse_args()
    n, step = a.blocks, max(1, a.blocks // 10)
    base = tempfile.mkdtemp(prefix="fill-trace-", dir=a.dir)
    path = os.path.join(base, "store")
    marks: list[tuple[int, float, float, int, int, int]] = []

    def start() -> tuple[float, float, dict[str, int], int, tuple[float, float]]:
        """The counters at the first put (imports and the open not counted)."""
        return time.perf_counter(), sum(os.times()[:2]), io(), disk_written(a.dev), sched()

    t0, cpu0, io0, disk0, sched0 = start()

    def mark(i: int) -> None:
        d = io()
        marks.append(
            (
                i,
                time.perf_counter() - t0,
                sum(os.times()[:2]) - cpu0,
                rss_file(),
                d["read_bytes"] - io0["read_bytes"],
                d["write_bytes"] - io0["write_bytes"],
            )
        )

    if a.raw:
        from tiercache.tiers.lmdb import map_size_for

        os.makedirs(path, mode=0o700)
        env = lmdb.open(path, map_size=map_size_for(n, 4096), max_dbs=1)
        db = env.open_db(b"blocks")
        t0, cpu0, io0, disk0, sched0 = start()
        for s in range(0, n, 256):
            m = min(256, n - s)
            data = rows(s, m, 4096)
            for j in range(0, m, 64):
                with env.begin(write=True, db=db) as txn:
                    for i in range(j, min(m, j + 64)):
                        txn.put(key(s + i), data[i])
            if (s + m) // step != s // step:
                mark(s + m)
        env.close()
    else:
        import torch

        from tiercache import TierCache

        overrides = json.loads(a.open)
        real_open = lmdb.open

        def patched_open(p: str, **kw: Any) -> lmdb.Environment:
            return real_open(p, **{**kw, **overrides})

        lmdb.open = patched_open  # every open of py-lmdb's, the tier's included
        cfg = config("lmdb", path, n)
        cfg["tiers"][0]["sync"] = a.sync
        cache = TierCache.open(cfg, block_bytes=4096)
        t0, cpu0, io0, disk0, sched0 = start()
        for s in range(0, n, 256):
            m = min(256, n - s)
            cache.put([key(i) for i in range(s, s + m)], torch.from_numpy(rows(s, m, 4096)))
            if (s + m) // step != s // step:
                mark(s + m)
        cache.close()
    total = time.perf_counter() - t0
    run, wait = (x - y for x, y in zip(sched(), sched0, strict=True))
    what = "raw py-lmdb" if a.raw else f"tier open={a.open} sync={a.sync}"
    print(
        f"{what}: {n:,} blocks, {n / marks[-1][1]:,.0f}/s over the puts, {total:.1f} s with "
        f"close; disk wrote {(disk_written(a.dev) - disk0) / 1e9:.2f} GB (all processes); "
        f"on CPU {run:.1f} s, waiting for a CPU {wait:.1f} s"
    )
    prev = (0, 0.0, 0.0)
    for i, t, c, rss, rb, wb in marks:
        dt = t - prev[1]
        print(
            f"{i:>9,} {(i - prev[0]) / dt:>9,.0f}/s cpu {(c - prev[2]) / dt:4.2f} "
            f"rssfile {rss / 2**20:6,.0f} MiB read {rb / 1e9:6.2f} GB written {wb / 1e9:6.2f} GB"
        )
        prev = (i, t, c)
    shutil.rmtree(base)


if __name__ == "__main__":
    main()
