"""Run the whole benchmark: traces, manager throughput against vLLM, hit rate against capacity
(LRU, ARC, vLLM's LRU and ARC, Belady's optimum), a whole-cache replay on real tiers, and the
same-run baselines. `run_bench(BenchOptions) -> BenchReport`; `report.py` renders it.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiercache.benchharness import baselines
from tiercache.benchharness.baselines import Pair
from tiercache.benchharness.belady import belady
from tiercache.benchharness.replay import (
    CacheRun,
    ManagerRun,
    replay_cache,
    replay_manager,
    replay_vllm,
    vllm_available,
)
from tiercache.benchharness.traces import GENERATORS, Trace, load_jsonl, make_trace
from tiercache.tiers.pool import memory_bytes

QUICK_FRACTIONS = (0.05, 0.2)
FULL_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8)
SPEED_FRACTION = 0.2  # capacity (share of the trace's distinct blocks) for the ops/s race
# The whole-cache replay: CPU, NVMe and LMDB tiers holding these shares of the footprint.
TIER_FRACTIONS = (0.05, 0.15, 0.3)
# The baselines' names in the ratio table.
VLLM_ARC, BELADY = "vLLM ARC, same capacity", "Belady's optimum (ceiling)"
BELADY_TOTAL, MEMCPY = "Belady's optimum at the total capacity", "memcpy of the same bytes"


@dataclass(frozen=True)
class BenchOptions:
    """What to run. `requests` per synthetic trace; `cache_requests` for the (slower) replay
    through real tiers; `directory` holds the persistent tiers' files (a temp dir if None)."""

    quick: bool = False
    traces: tuple[str, ...] = tuple(GENERATORS)
    trace_file: Path | None = None
    requests: int = 3000
    cache_requests: int = 1000
    seed: int = 0
    runs: int = 5
    block_bytes: int = 4096
    fractions: tuple[float, ...] = FULL_FRACTIONS
    directory: Path | None = None
    with_vllm: bool = True

    @classmethod
    def quick_defaults(cls, **kw: Any) -> BenchOptions:
        """The `--quick` sizes: finishes in well under two minutes on a 2-core VM."""
        quick = {"requests": 600, "cache_requests": 200, "runs": 3, "fractions": QUICK_FRACTIONS}
        return cls(**{"quick": True, **quick, **kw})


@dataclass(frozen=True)
class SpeedRow:
    """Median manager throughput of one implementation on one trace and capacity."""

    trace: str
    name: str
    capacity: int
    ops_per_s: float
    hit_rate: float
    runs: int


@dataclass(frozen=True)
class CurvePoint:
    """Hit rates of every policy at one capacity of one trace."""

    trace: str
    fraction: float
    capacity: int
    hit_rates: dict[str, float]


@dataclass(frozen=True)
class CacheRow:
    """One whole-cache replay and its references: Belady and single-tier LRU/ARC at the sum
    of the tiers' capacities, and memcpy of the same bytes."""

    run: CacheRun
    total_capacity: int
    belady_hit_rate: float
    memcpy_bps: float


@dataclass
class BenchReport:
    """Everything one run measured."""

    machine: str
    started: str
    options: BenchOptions
    traces: list[dict[str, Any]] = field(default_factory=list)
    speed: list[SpeedRow] = field(default_factory=list)
    curves: list[CurvePoint] = field(default_factory=list)
    cache: list[CacheRow] = field(default_factory=list)
    pairs: list[Pair] = field(default_factory=list)
    vllm: str | None = None

    def ratio_rows(self) -> list[Pair]:
        """The headline table: every tiercache figure next to its same-run baseline."""
        rows: list[Pair] = []
        by = {(r.trace, r.name): r for r in self.speed}
        for t in self.traces:
            name = t["name"]
            for pol in ("arc", "lru"):
                ours, theirs = by.get((name, f"tiercache {pol}")), by.get((name, f"vllm {pol}"))
                if ours and theirs:
                    what = f"{name}: manager {pol.upper()} block-ops/s"
                    base = f"vLLM CPUOffloadingManager {pol!r}"
                    rows.append(Pair(what, ours.ops_per_s, theirs.ops_per_s, "ops/s", base))
            for p in self.curves:
                if p.trace != name or p.fraction != SPEED_FRACTION:
                    continue
                h, what = p.hit_rates, f"{name}: ARC hit rate at {p.capacity} blocks"
                if "vllm arc" in h:
                    rows.append(Pair(what, h["tiercache arc"], h["vllm arc"], "hit rate", VLLM_ARC))
                rows.append(Pair(what, h["tiercache arc"], h["belady"], "hit rate", BELADY))
        for c in self.cache:
            r = c.run
            what = f"{r.trace}: CPU+NVMe+LMDB hit rate, {c.total_capacity} blocks in all"
            rows.append(Pair(what, r.hit_rate, c.belady_hit_rate, "hit rate", BELADY_TOTAL))
            what, mbps = f"{r.trace}: whole-cache replay, bytes moved", r.bytes_moved / r.seconds
            rows.append(Pair(what, mbps / 1e6, c.memcpy_bps / 1e6, "MB/s", MEMCPY))
        return rows + self.pairs

    def targets(self) -> list[tuple[str, str, bool]]:
        """(target, what this run measured, met?) for the targets the project set itself."""
        out: list[tuple[str, str, bool]] = []
        by = {(r.trace, r.name): r for r in self.speed}
        for t in self.traces:
            ours, theirs = by.get((t["name"], "tiercache arc")), by.get((t["name"], "vllm arc"))
            if ours and theirs:
                ratio = ours.ops_per_s / theirs.ops_per_s
                what = f"{t['name']}: manager >= 2.5x vLLM ARC block-ops/s"
                out.append((what, f"{ratio:.2f}x", ratio >= 2.5))
        pts = [p for p in self.curves if "vllm arc" in p.hit_rates]
        if pts:
            worse = [p for p in pts if p.hit_rates["tiercache arc"] < p.hit_rates["vllm arc"]]
            detail = ", ".join(
                f"{p.trace}@{p.fraction:.0%} "
                + _apart(p.hit_rates["tiercache arc"], p.hit_rates["vllm arc"], "<")
                for p in worse
            )
            measured = f"{len(pts) - len(worse)}/{len(pts)} points"
            measured += f" (below: {detail})" if worse else ""
            out.append(("ARC hit rate >= vLLM ARC at equal capacity", measured, not worse))
        for c in self.cache:
            if c.run.trace == "chat":
                ratio = c.run.hit_rate / c.belady_hit_rate if c.belady_hit_rate else 0.0
                what = "chat, CPU+NVMe+LMDB: hit rate within 5% of Belady"
                out.append((what, f"{ratio:.3f} of Belady", ratio >= 0.95))
        return out


def machine_description() -> str:
    """One line naming the machine: CPU model, cores, memory, GPU (if any), OS, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram = memory_bytes(torch.device("cpu"))
    mem = f", {ram / 2**30:.0f} GiB RAM" if ram is not None else ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} cores{mem}, {gpu}; {platform.system()} {platform.release()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def _apart(a: float, b: float, op: str) -> str:
    """`a op b` with 4 decimals, or as many more (up to 8) as it takes for them to differ."""
    for d in range(4, 9):
        x, y = f"{a:.{d}f}", f"{b:.{d}f}"
        if x != y:
            break
    return f"{x}{op}{y}"


def _traces(opts: BenchOptions) -> list[Trace]:
    out = [make_trace(n, opts.requests, seed=opts.seed) for n in opts.traces]
    if opts.trace_file is not None:
        out.append(load_jsonl(opts.trace_file))
    if not out:
        raise ValueError("traces: nothing to run (no synthetic trace and no --trace-file)")
    return out


def _cap(trace: Trace, fraction: float) -> int:
    return max(1, round(trace.unique_blocks * fraction))


def _speed(trace: Trace, opts: BenchOptions, use_vllm: bool) -> list[SpeedRow]:
    """Median ops/s per implementation; one warm-up each, then runs interleaved."""
    cap = _cap(trace, SPEED_FRACTION)
    fns: dict[str, Callable[[], ManagerRun | None]] = {}
    for pol in ("lru", "arc"):
        fns[f"tiercache {pol}"] = lambda p=pol: replay_manager(trace, p, cap)
        if use_vllm:
            fns[f"vllm {pol}"] = lambda p=pol: replay_vllm(trace, p, cap)
    got: dict[str, list[ManagerRun]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up: first-touch allocations would otherwise land on whoever runs first
    for _ in range(opts.runs):
        for k, fn in fns.items():
            r = fn()
            if r is not None:
                got[k].append(r)
    rows = []
    for k, rs in got.items():
        if rs:
            ops = statistics.median(r.ops_per_s for r in rs)
            rows.append(SpeedRow(trace.name, k, cap, ops, rs[0].hit_rate, len(rs)))
    return rows


def _curve(trace: Trace, opts: BenchOptions, use_vllm: bool) -> list[CurvePoint]:
    points = []
    for f in opts.fractions:
        cap = _cap(trace, f)
        h = {
            "tiercache lru": replay_manager(trace, "lru", cap).hit_rate,
            "tiercache arc": replay_manager(trace, "arc", cap).hit_rate,
            "belady": belady(trace.requests, cap).hit_rate,
        }
        if use_vllm:
            for pol in ("lru", "arc"):
                r = replay_vllm(trace, pol, cap)
                if r is not None:
                    h[f"vllm {pol}"] = r.hit_rate
        points.append(CurvePoint(trace.name, f, cap, h))
    return points


def cache_config(trace: Trace, directory: Path) -> dict[str, Any]:
    """CPU (ARC) over NVMe over LMDB, sized as TIER_FRACTIONS of the trace's footprint."""
    caps = [_cap(trace, f) for f in TIER_FRACTIONS]
    return {
        "block_size": trace.block_size,
        "namespace": f"tiercache-bench/{trace.name}",
        "tiers": [
            {"kind": "cpu", "blocks": caps[0], "policy": "arc", "pin_memory": False},
            {
                "kind": "nvme",
                "blocks": caps[1],
                "policy": "arc",
                "path": str(directory / "nvme"),
                "fsync": "never",
            },
            {
                "kind": "lmdb",
                "blocks": caps[2],
                "policy": "arc",
                "path": str(directory / "lmdb"),
                "compression": "none",
                "sync": "never",
            },
        ],
    }


def _cache(trace: Trace, opts: BenchOptions, root: Path) -> CacheRow:
    t = trace.head(opts.cache_requests)
    with tempfile.TemporaryDirectory(
        prefix=f"{t.name}-", dir=root, ignore_cleanup_errors=True
    ) as d:
        cfg = cache_config(t, Path(d))
        run = replay_cache(t, cfg, opts.block_bytes)
    total = sum(tc["blocks"] for tc in cfg["tiers"])
    return CacheRow(
        run,
        total,
        belady(t.requests, total).hit_rate,
        baselines.memcpy_bps(run.bytes_moved, runs=3),
    )


def run_bench(opts: BenchOptions, log: Callable[[str], None] = lambda s: None) -> BenchReport:
    """Run everything `opts` asks for; `log` gets one line per step."""
    use_vllm = opts.with_vllm and vllm_available()
    vllm_version = None
    if use_vllm:
        import vllm

        vllm_version = getattr(vllm, "__version__", "?")
    report = BenchReport(
        machine_description(),
        _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        opts,
        vllm=vllm_version,
    )
    log(f"vLLM: {vllm_version}" if use_vllm else "vLLM: not importable, its rows are skipped")
    traces = _traces(opts)
    for t in traces:
        report.traces.append(
            {
                "name": t.name,
                "requests": len(t.requests),
                "blocks": t.n_blocks,
                "unique_blocks": t.unique_blocks,
            }
        )
        log(
            f"{t.name}: {len(t.requests)} requests, {t.n_blocks} blocks, {t.unique_blocks} distinct"
        )
        report.speed += _speed(t, opts, use_vllm)
        log(f"{t.name}: manager throughput done")
        report.curves += _curve(t, opts, use_vllm)
        log(f"{t.name}: hit rate vs capacity done")
    with tempfile.TemporaryDirectory(
        prefix="tiercache-bench-", dir=opts.directory, ignore_cleanup_errors=True
    ) as tmp:
        root = Path(tmp)
        # Quick: the chat trace (the target's) and any user trace; full: every trace.
        quick_names = {"chat"} | ({traces[-1].name} if opts.trace_file else set())
        cache_traces = [t for t in traces if not opts.quick or t.name in quick_names]
        for t in cache_traces:
            report.cache.append(_cache(t, opts, root))
            log(f"{t.name}: whole-cache replay done")
        runs = 3 if opts.quick else opts.runs
        report.pairs.append(baselines.hashing_pair(runs=runs))
        report.pairs += baselines.cpu_tier_pair(runs=runs)
        report.pairs += baselines.nvme_pair(str(root), runs=runs)
        report.pairs += baselines.lmdb_pair(str(root), runs=runs)
        log("baselines done")
    return report
