"""Write policies on the harness's traces: write-back, write-through (the default right below
a volatile tier), and either with admission on reuse; write-around happens in all of them
whenever a request's misses do not fit the first tier.

Each run replays a trace through the facade as a serving engine would (get the prefix,
put the misses) on the harness's CPU (ARC) over NVMe over LMDB configuration, with real
files, then `flush()` (the write-through copier's backlog is part of the cost). Reported
per run: hit rate, blocks per second of the whole replay, bytes written into each tier,
blocks written around the first tier, blocks kept out by admission, write-through drops.
Ratios are against write-back on the same trace in the same run; each variant runs
`--runs` times interleaved and the median time is kept (hit rates are deterministic).

    .venv/bin/python bench/bench_write_policies.py [--requests 1200] [--runs 3]
        [--traces chat,rag,agentic,scan] [--block-kib 16] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tiercache import TierCache
from tiercache.benchharness.replay import stand_in_blocks
from tiercache.benchharness.runner import cache_config
from tiercache.benchharness.traces import Trace, make_trace

VARIANTS: dict[str, dict[str, Any]] = {
    "write-back": {"nvme": {"write_policy": "write-back"}},
    "write-through": {},  # the default: nvme (below the volatile cpu tier) written through
    "write-back + admit": {
        "nvme": {"write_policy": "write-back", "admit": "on-reuse"},
        "lmdb": {"admit": "on-reuse"},
    },
    "write-through + admit": {"nvme": {"admit": "on-reuse"}, "lmdb": {"admit": "on-reuse"}},
}


def config_for(trace: Trace, directory: Path, variant: str) -> dict[str, Any]:
    cfg = cache_config(trace, directory)
    for tier in cfg["tiers"]:
        tier.update(VARIANTS[variant].get(tier["kind"], {}))
    return cfg


def replay(trace: Trace, cfg: dict[str, Any], block_bytes: int) -> dict[str, Any]:
    """One replay; hit rate, time, and per tier the blocks written and the counters."""
    hits = blocks = 0
    with TierCache.open(cfg, block_bytes=block_bytes) as cache:
        written = {t.medium: 0 for t in cache.tiers}
        for t in cache.tiers:  # count bytes written per tier, whoever writes (thread too)
            write = t.write

            def counted(slots: Any, src: Any, keys: Any = None, _w=write, _m=t.medium) -> None:
                _w(slots, src, keys)
                written[_m] += len(slots)

            t.write = counted  # type: ignore[method-assign]
        out = torch.empty((max(len(r) for r in trace.requests), block_bytes), dtype=torch.uint8)
        t0 = time.perf_counter()
        for keys in trace.requests:
            n = len(cache.get(keys, out=out[: len(keys)]))
            if n < len(keys):
                cache.put(keys[n:], stand_in_blocks(keys[n:], block_bytes))
            hits += n
            blocks += len(keys)
        cache.flush()
        secs = time.perf_counter() - t0
        stats = cache.stats()
    around = {
        m: s["stored"] - s["demoted_in"] - s["written_through"]
        for m, s in stats.items()
        if m != "cpu"
    }
    return {
        "hit_rate": hits / blocks,
        "seconds": secs,
        "blocks": blocks,
        "written": written,
        "around": around,
        "not_admitted": sum(s["not_admitted"] for s in stats.values()),
        "through_dropped": sum(s["through_dropped"] for s in stats.values()),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--traces", default="chat,rag,agentic,scan")
    ap.add_argument("--block-kib", type=int, default=16)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    args = ap.parse_args(argv)
    bb = args.block_kib * 1024
    root = Path(tempfile.mkdtemp(prefix="tiercache-writes-", dir=args.dir))
    print(f"{args.requests} requests per trace, {args.block_kib} KiB blocks, {args.runs} runs")
    print(
        "| trace | policy | hit rate | blocks/s (x write-back) | MiB written cpu/nvme/lmdb "
        "| written around nvme/lmdb | not admitted | through dropped |"
    )
    print("|---|---|---|---|---|---|---|---|")
    try:
        for name in args.traces.split(","):
            trace = make_trace(name, args.requests, seed=0)
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            for i in range(args.runs):
                for v in VARIANTS:  # interleaved: drift hits every variant alike
                    d = root / f"{name}-{v.replace(' ', '')}-{i}"
                    d.mkdir()
                    runs[v].append(replay(trace, config_for(trace, d, v), bb))
                    shutil.rmtree(d, ignore_errors=True)
            base = statistics.median(r["blocks"] / r["seconds"] for r in runs["write-back"])
            for v, rs in runs.items():
                speed = statistics.median(r["blocks"] / r["seconds"] for r in rs)
                r = rs[0]
                mib = "/".join(f"{r['written'][m] * bb / 2**20:.0f}" for m in r["written"])
                around = "/".join(str(r["around"][m]) for m in r["around"])
                print(
                    f"| {name} | {v} | {r['hit_rate']:.4f} | {speed:,.0f} ({speed / base:.2f}x) "
                    f"| {mib} | {around} | {r['not_admitted']} | {r['through_dropped']} |"
                )
            sys.stdout.flush()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
