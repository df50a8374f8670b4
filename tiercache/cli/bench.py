"""`tiercache bench`: replay seeded traces (or your JSONL trace) through tiercache and its
baselines in one run, print the ratio table, and (full run or --out) write a markdown report,
a hit-rate-vs-capacity PNG and JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from tiercache.benchharness.report import markdown, pair_cells, plot_curves, to_json
from tiercache.benchharness.runner import BenchOptions, run_bench
from tiercache.benchharness.traces import GENERATORS


def _trace_names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if value.strip().lower() == "none":
        return ()
    for n in names:
        if n not in GENERATORS:
            raise click.BadParameter(
                f"unknown trace {n!r}; expected a comma list of {', '.join(GENERATORS)} or 'none'",
                param_hint="--traces",
            )
    return names


@click.command()
@click.option("--quick", is_flag=True, help="Small traces and few runs (under two minutes).")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write report.md, hitrate.png, report.json here (default for a full run: "
    "./tiercache-bench).",
)
@click.option(
    "--traces",
    "traces",
    default=",".join(GENERATORS),
    show_default=True,
    help="Synthetic traces to run, comma-separated, or 'none'.",
)
@click.option(
    "--trace-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A JSONL trace: one request per line with 'timestamp' and one of 'hash_ids' "
    "(Mooncake), 'block_hashes' (32 hex digits) or 'token_ids'.",
)
@click.option("--requests", type=click.IntRange(min=1), default=None, help="Requests per trace.")
@click.option(
    "--cache-requests",
    type=click.IntRange(min=1),
    default=None,
    help="Requests replayed through the real tiers (slower; a prefix of each trace).",
)
@click.option("--runs", type=click.IntRange(min=1), default=None, help="Timed runs (median kept).")
@click.option("--seed", default=0, show_default=True, help="Trace seed.")
@click.option(
    "--block-bytes",
    type=click.IntRange(min=16),
    default=4096,
    show_default=True,
    help="Bytes per block in the whole-cache replay.",
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the NVMe/LMDB tiers and baselines put their files (default: a temp dir); "
    "point it at the disk you want measured.",
)
@click.option("--no-vllm", is_flag=True, help="Skip vLLM's managers even if importable.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench(
    quick: bool,
    out: Path | None,
    traces: str,
    trace_file: Path | None,
    requests: int | None,
    cache_requests: int | None,
    runs: int | None,
    seed: int,
    block_bytes: int,
    directory: Path | None,
    no_vllm: bool,
    as_json: bool,
) -> None:
    """Measure tiercache against same-run baselines and print the ratios.

    Baselines: vLLM's own CPUOffloadingManager (LRU, ARC) on the same trace and capacity when
    vLLM is importable, Belady's optimal policy, memcpy, raw O_DIRECT pread/pwrite, raw
    py-lmdb, a hashlib sha256 chain.

    \b
    Examples:
      tiercache bench --quick
      tiercache bench --out bench-results --dir /mnt/nvme/tmp
      tiercache bench --traces none --trace-file mooncake_trace.jsonl --quick
    """
    kw: dict[str, object] = {
        "traces": _trace_names(traces),
        "trace_file": trace_file,
        "seed": seed,
        "block_bytes": block_bytes,
        "directory": directory,
        "with_vllm": not no_vllm,
    }
    for name, value in (("requests", requests), ("cache_requests", cache_requests), ("runs", runs)):
        if value is not None:
            kw[name] = value
    opts = BenchOptions.quick_defaults(**kw) if quick else BenchOptions(**kw)  # type: ignore[arg-type]
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    err = Console(stderr=True)
    t0 = time.perf_counter()
    with err.status("tiercache bench") as status:
        report = run_bench(
            opts, log=lambda s: status.update(f"[{time.perf_counter() - t0:5.1f}s] {s}")
        )
    if out is None and not quick:
        out = Path("tiercache-bench")
    written: list[Path] = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text(markdown(report), encoding="utf-8")
        (out / "report.json").write_text(json.dumps(to_json(report), indent=2), encoding="utf-8")
        written = [out / "report.md", out / "report.json", plot_curves(report, out / "hitrate.png")]
    if as_json:
        click.echo(json.dumps(to_json(report), indent=2))
        return
    console = Console()
    table = Table(title=f"tiercache bench ({'quick' if quick else 'full'}): ratios, same run")
    for col in ("what", "tiercache", "baseline (same run)", "ratio"):
        table.add_column(col, justify="left" if col != "ratio" else "right", overflow="fold")
    for p in report.ratio_rows():
        table.add_row(*pair_cells(p))
    console.print(table)
    for target, measured, ok in report.targets():
        mark = "[green]met[/green]" if ok else "[red]missed[/red]"
        console.print(f"target: {target}: {measured} {mark}")
    console.print(f"machine: {report.machine}")
    if report.vllm is None:
        console.print("vLLM not importable here: its rows are skipped (run under a vLLM venv).")
    console.print(f"took {time.perf_counter() - t0:.1f} s")
    for p in written:
        console.print(f"wrote {p}")
