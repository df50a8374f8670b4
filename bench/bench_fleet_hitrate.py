"""Hit rate of 1, 2 and 4 engines sharing one LMDB store vs each engine alone, same run.

Each engine is a `TierCache` in its own process (as vLLM engines are), configured alike: a
CPU tier of `--cpu` and an LMDB tier of `--lmdb` (shares of the trace's distinct blocks).
The harness's trace is dealt to the engines round-robin, as a load balancer without session
affinity would; the engines replay their parts at the same time (`replay_cache`: get the
prefix, every served block checked against its key, put the rest). "shared": every engine's
LMDB tier is one directory, whose capacity (per namespace, kept in the store) all of them
share, and a lookup miss discovers what the others stored. "alone": one directory per engine,
each with that capacity (n times the storage of "shared"); "alone/n": one directory per
engine with 1/n of the CPU and LMDB capacity (the same storage in all as "shared").
Hit rate = blocks served / blocks requested, over all engines.

The interleaving of concurrent processes differs from run to run: medians over `--runs`
(default 1: about 3 minutes on a 2-core VM).

Run: .venv/bin/python bench/bench_fleet_hitrate.py [--requests 300] [--runs 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time

from tiercache.benchharness.replay import replay_cache
from tiercache.benchharness.traces import GENERATORS, Trace, make_trace

BLOCK_BYTES = 4096


def engine(trace: Trace, config: dict, go, out) -> None:
    go.wait()
    run = replay_cache(trace, config, BLOCK_BYTES)
    st = run.stats["lmdb"]
    out.put((run.hits, run.blocks, st["discovered"], st["errors"]))


def deal(trace: Trace, n: int) -> list[Trace]:
    """Request i goes to engine i % n."""
    return [
        Trace(trace.name, trace.requests[e::n], trace.timestamps[e::n], trace.block_size)
        for e in range(n)
    ]


def run(trace: Trace, n: int, mode: str, cpu: int, lmdb: int) -> dict:
    """One replay with `n` engines; `mode` "shared", "alone" or "alone/n" (capacity / n)."""
    shared = mode == "shared"
    if mode == "alone/n":
        cpu, lmdb = max(1, cpu // n), max(1, lmdb // n)
    d = tempfile.mkdtemp(prefix="bench-fleet-")
    try:
        go, out = mp.Event(), mp.Queue()
        procs = []
        for e, part in enumerate(deal(trace, n)):
            path = f"{d}/shared" if shared else f"{d}/alone-{e}"
            config = {
                "namespace": "bench",
                "tiers": [
                    {"kind": "cpu", "blocks": cpu},
                    {"kind": "lmdb", "blocks": lmdb, "path": path, "compression": "none"},
                ],
            }
            procs.append(mp.Process(target=engine, args=(part, config, go, out)))
        for p in procs:
            p.start()
        time.sleep(0.5)
        go.set()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"an engine process failed (exit {p.exitcode})")
        got = [out.get(timeout=10) for _ in procs]
        hits, blocks = sum(g[0] for g in got), sum(g[1] for g in got)
        return {
            "hit_rate": hits / blocks,
            "discovered": sum(g[2] for g in got),
            "errors": sum(g[3] for g in got),
        }
    finally:
        shutil.rmtree(d)


def ratio(rows: dict[str, list[dict]], base: str) -> float:
    """Median over runs of shared hit rate / `base` hit rate (pairs from the same round)."""
    return statistics.median(
        s["hit_rate"] / b["hit_rate"] if b["hit_rate"] else float("nan")
        for s, b in zip(rows["shared"], rows[base], strict=True)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", default=list(GENERATORS))
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--cpu", type=float, default=0.05, help="CPU tier, share of distinct blocks")
    ap.add_argument("--lmdb", type=float, default=0.3, help="LMDB tier, share of distinct blocks")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    modes = ("alone", "alone/n", "shared")
    print(
        "| trace | engines | alone | alone, capacity/n | shared | shared / alone "
        "| shared / (alone, capacity/n) | discovered (shared) | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in a.traces:
        trace = make_trace(name, a.requests, seed=a.seed)
        u = trace.unique_blocks
        cpu, lmdb = max(1, round(a.cpu * u)), max(1, round(a.lmdb * u))
        for n in a.engines:
            rows = {m: [run(trace, n, m, cpu, lmdb) for _ in range(a.runs)] for m in modes}
            med = {m: statistics.median(r["hit_rate"] for r in rows[m]) for m in modes}

            disc = statistics.median(r["discovered"] for r in rows["shared"])
            errors = sum(r["errors"] for m in rows.values() for r in m)
            print(
                f"| {name} | {n} | {med['alone']:.3f} | {med['alone/n']:.3f} "
                f"| {med['shared']:.3f} | {ratio(rows, 'alone'):.2f}x "
                f"| {ratio(rows, 'alone/n'):.2f}x "
                f"| {disc:.0f} | {errors} |",
                flush=True,
            )


if __name__ == "__main__":
    mp.set_start_method("fork")
    main()
