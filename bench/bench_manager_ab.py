"""Compare the manager's speed at two git revisions on the harness's traces.

Each revision's `tiercache`, `tiers/` and `policies/` are laid out as an importable package in
a temporary directory (`git archive`, so uncommitted changes are not included), and
`replay_manager` runs in fresh processes that alternate between the two revisions. Each
process replays the trace `--runs` times after one warm-up. Time is process CPU time, not
wall time, so a neighbour on the shared 2-core VM adds noise but not its own run time. The
hit counts are printed too: a speed change must not change what hits. Give a revision twice
for a null test of the noise: on the 2-core VM, 3 rounds of 3 runs spread by up to 7 %, so
read a difference smaller than that as none.

    .venv/bin/python bench/bench_manager_ab.py 1cee2bd HEAD --traces scan,rag --policy arc
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _child import child_json

REPO = Path(__file__).resolve().parent.parent

# Run inside each child: the replay with time.perf_counter swapped for process CPU time.
CHILD = """
import json, sys, time
import tiercache
from tiercache.benchharness import replay
from tiercache.benchharness.traces import make_trace

name, policy, runs, requests, fraction = sys.argv[1:6]
trace = make_trace(name, int(requests), seed=0)
cap = max(1, round(trace.unique_blocks * float(fraction)))
replay.time.perf_counter = time.process_time
out = [replay.replay_manager(trace, policy, cap) for _ in range(int(runs) + 1)][1:]
print(json.dumps({"seconds": [r.seconds for r in out], "hits": out[0].hits, "cap": cap,
                  "from": tiercache.__file__}))
"""


def lay_out(rev: str, root: Path) -> Path:
    """`tiercache/`, with `tiers/` and `policies/` inside it, as of `rev`; returns sys.path dir."""
    tar = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "tiercache", "tiers", "policies"],
        check=True,
        capture_output=True,
    ).stdout
    src = root / "src"
    with tarfile.open(fileobj=BytesIO(tar)) as t:
        t.extractall(src, filter="data")
    pkg = root / "pkg"
    shutil.copytree(src / "tiercache", pkg / "tiercache")
    shutil.copytree(src / "tiers", pkg / "tiercache" / "tiers")
    shutil.copytree(src / "policies", pkg / "tiercache" / "policies")
    return pkg


def run_child(path: Path, args: argparse.Namespace, trace: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path)}
    argv = [trace, args.policy, str(args.runs), str(args.requests), str(args.fraction)]
    # cwd: `python -c` puts it first on sys.path, and the repository root holds a tiercache/
    # that would shadow the revision being measured.
    got = child_json([sys.executable, "-c", CHILD, *argv], env=env, cwd=path, what=f"child {trace}")
    if not got["from"].startswith(str(path)):
        raise SystemExit(f"measured the wrong tiercache: {got['from']} is not under {path}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="git revision A (e.g. a commit, a tag, HEAD~3)")
    ap.add_argument("new", help="git revision B")
    ap.add_argument("--traces", default="chat,rag,agentic,scan")
    ap.add_argument("--policy", default="arc", choices=["lru", "arc"])
    ap.add_argument("--rounds", type=int, default=3, help="processes per revision, alternating")
    ap.add_argument("--runs", type=int, default=3, help="timed replays per process")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--fraction", type=float, default=0.2, help="capacity / distinct blocks")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tiercache-ab-") as tmp:
        # Keyed by position, so a revision against itself (a null test of the noise) works.
        paths = [lay_out(rev, Path(tmp) / str(i)) for i, rev in enumerate((args.old, args.new))]
        print(f"# {args.policy}, {args.requests} requests, capacity {args.fraction:.0%}")
        print("| trace | capacity | A ms | B ms | B/A time | hits A | hits B |")
        print("|---|---|---|---|---|---|---|")
        for trace in args.traces.split(","):
            got: list[list[float]] = [[], []]
            hits = [0, 0]
            for _ in range(args.rounds):
                for i, path in enumerate(paths):
                    r = run_child(path, args, trace)
                    got[i] += r["seconds"]
                    hits[i], cap = r["hits"], r["cap"]
            a, b = (statistics.median(g) for g in got)
            ha, hb = hits
            print(
                f"| {trace} | {cap} | {a * 1e3:.0f} | {b * 1e3:.0f} | {b / a:.3f} | {ha} | {hb} |"
            )
        print(f"# A = {args.old}, B = {args.new}; median process CPU time per replay")


if __name__ == "__main__":
    main()
