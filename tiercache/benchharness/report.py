"""Render a `BenchReport`: the ratio table (plain text rows for a terminal), a markdown report,
a PNG of hit rate against capacity per trace, and JSON for scripts.

Primitives: `ratio_lines(report)`, `markdown(report)`, `plot_curves(report, path)`,
`to_json(report)`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tiercache.benchharness.baselines import Pair
from tiercache.benchharness.runner import BenchReport

TIER_COLUMNS = ["tier", "capacity", "hit rate", "MB read", "MB written", "read MB/s", "write MB/s"]
CURVE_ORDER = ("belady", "tiercache arc", "tiercache lru", "vllm arc", "vllm lru")
_STYLE = {
    "belady": ("k", "--"),
    "tiercache arc": ("tab:blue", "-"),
    "tiercache lru": ("tab:orange", "-"),
    "vllm arc": ("tab:blue", ":"),
    "vllm lru": ("tab:orange", ":"),
}


def _fmt(v: float, unit: str) -> str:
    if unit == "hit rate":
        return f"{v:.4f}"
    if v >= 1e6:
        return f"{v / 1e6:.2f} M {unit}"
    if v >= 1e4:
        return f"{v / 1e3:.1f} k {unit}"
    return f"{v:.0f} {unit}"


def pair_cells(p: Pair) -> list[str]:
    """[what, tiercache, baseline, ratio] as display strings."""
    what = p.name + (f" ({p.note})" if p.note else "")
    base = f"{_fmt(p.base, p.unit)} ({p.baseline})"
    return [what, _fmt(p.ours, p.unit), base, f"{p.ratio:.2f}x"]


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def markdown(report: BenchReport) -> str:
    """The full report as markdown: machine, ratio table, throughput, curves, tiers."""
    o = report.options
    parts = [
        "# tiercache benchmark",
        "",
        f"- Machine: {report.machine}",
        f"- Run: {report.started}; {'quick' if o.quick else 'full'}; seed {o.seed}; "
        f"medians of {o.runs} runs; vLLM {report.vllm or 'not importable (rows skipped)'}",
        "",
        "## Ratios against same-run baselines",
        "",
        _table(
            ["what", "tiercache", "baseline (same run)", "ratio"],
            [pair_cells(p) for p in report.ratio_rows()],
        ),
        "",
        "## Targets",
        "",
        _table(
            ["target", "measured", "met"],
            [[t, m, "yes" if ok else "no"] for t, m, ok in report.targets()],
        ),
        "",
        "## Traces",
        "",
        _table(
            ["trace", "requests", "block accesses", "distinct blocks"],
            [
                [t["name"], str(t["requests"]), str(t["blocks"]), str(t["unique_blocks"])]
                for t in report.traces
            ],
        ),
        "",
        "## Manager throughput (block-ops/s, median)",
        "",
        _table(
            ["trace", "manager", "capacity (blocks)", "block-ops/s", "hit rate"],
            [
                [
                    r.trace,
                    r.name,
                    str(r.capacity),
                    f"{r.ops_per_s / 1e6:.2f} M",
                    f"{r.hit_rate:.4f}",
                ]
                for r in report.speed
            ],
        ),
        "",
        "## Hit rate against capacity",
        "",
    ]
    names = [n for n in CURVE_ORDER if any(n in p.hit_rates for p in report.curves)]
    parts.append(
        _table(
            ["trace", "capacity (share of distinct)", "blocks", *names],
            [
                [
                    p.trace,
                    f"{p.fraction:.0%}",
                    str(p.capacity),
                    *(f"{p.hit_rates[n]:.4f}" if n in p.hit_rates else "-" for n in names),
                ]
                for p in report.curves
            ],
        )
    )
    for c in report.cache:
        r = c.run
        parts += [
            "",
            f"## Whole-cache replay: {r.trace} ({r.blocks} block accesses, "
            f"{r.block_bytes} B blocks)",
            "",
            f"Hit rate {r.hit_rate:.4f} (Belady at {c.total_capacity} blocks: "
            f"{c.belady_hit_rate:.4f}, ratio {r.hit_rate / c.belady_hit_rate:.3f}); "
            f"{r.blocks_per_s:,.0f} blocks/s; {r.bytes_moved / 1e6:.1f} MB moved.",
            "",
            _table(
                TIER_COLUMNS,
                [
                    [
                        f"{io.medium} ({io.kind})",
                        str(io.capacity_blocks),
                        f"{r.tier_hit_rate(io.medium):.4f}",
                        f"{io.read_bytes / 1e6:.1f}",
                        f"{io.write_bytes / 1e6:.1f}",
                        f"{io.read_bytes / io.read_s / 1e6:.0f}" if io.read_s else "-",
                        f"{io.write_bytes / io.write_s / 1e6:.0f}" if io.write_s else "-",
                    ]
                    for io in r.tiers
                ],
            ),
        ]
    return "\n".join(parts) + "\n"


def plot_curves(report: BenchReport, path: str | Path) -> Path:
    """One panel per trace: hit rate against capacity for each policy (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(p.trace for p in report.curves))
    if not traces:
        raise ValueError("plot: the report has no hit-rate curves")
    fig, axes = plt.subplots(1, len(traces), figsize=(4.2 * len(traces), 3.6), squeeze=False)
    for ax, name in zip(axes[0], traces, strict=True):
        pts = sorted((p for p in report.curves if p.trace == name), key=lambda p: p.capacity)
        for n in CURVE_ORDER:
            xs = [p.capacity for p in pts if n in p.hit_rates]
            if xs:
                color, ls = _STYLE[n]
                ys = [p.hit_rates[n] for p in pts if n in p.hit_rates]
                ax.plot(xs, ys, ls, color=color, marker="o", ms=3, label=n)
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("capacity (blocks)")
        ax.set_ylabel("prefix hit rate")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def to_json(report: BenchReport) -> dict[str, Any]:
    """A JSON-ready dict of the report (ratios included)."""
    d = asdict(report)
    d["options"] = {k: str(v) if isinstance(v, Path) else v for k, v in d["options"].items()}
    d["ratios"] = [{**asdict(p), "ratio": p.ratio} for p in report.ratio_rows()]
    d["targets"] = [{"target": t, "measured": m, "met": ok} for t, m, ok in report.targets()]
    for c, row in zip(report.cache, d["cache"], strict=True):
        row["run"]["hit_rate"] = c.run.hit_rate
        row["run"]["bytes_moved"] = c.run.bytes_moved
        for io in row["run"]["tiers"]:  # next to its IO, each tier's lookup counts
            io.update({k: c.run.stats[io["medium"]][k] for k in ("hits", "misses")})
    return json.loads(json.dumps(d, default=str))
