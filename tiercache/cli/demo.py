"""`tiercache demo`: run a seeded chat + RAG workload through an embedded default config.

It stores stand-in KV bytes for every prompt block, reads hits back and checks every byte,
then prints per-tier hit rates, blocks and bytes moved, throughput, and the same-run memcpy
bandwidth for comparison.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.table import Table

from tiercache.benchharness.baselines import memcpy_bps
from tiercache.cache import TierCache
from tiercache.cli.progress import progress_bar
from tiercache.workload import block_bytes_for, synthetic_requests


def demo_config(directory: Path) -> dict[str, Any]:
    """The embedded default: a GPU tier when CUDA is present, a CPU tier, then the persistent
    tiers (under `directory`) when they are installed."""
    tiers: list[dict[str, Any]] = []
    if torch.cuda.is_available():
        tiers.append({"kind": "gpu", "capacity": "32MiB", "policy": "lru"})
    tiers.append({"kind": "cpu", "capacity": "48MiB", "policy": "arc"})
    if importlib.util.find_spec("tiercache.tiers.nvme") is not None:
        tiers.append(
            {"kind": "nvme", "capacity": "48MiB", "policy": "lru", "path": str(directory / "nvme")}
        )
    if importlib.util.find_spec("tiercache.tiers.lmdb") is not None:
        tiers.append(
            {"kind": "lmdb", "capacity": "256MiB", "policy": "lru", "path": str(directory / "lmdb")}
        )
    return {"block_size": 16, "namespace": "demo/synthetic-8b/bf16/bs16/tp1/0", "tiers": tiers}


def memcpy_gbps(nbytes: int = 256 * 2**20, runs: int = 5) -> float:
    """Median torch copy bandwidth (GB/s, payload counted once) measured now."""
    return memcpy_bps(nbytes, runs, cap=nbytes) / 1e9


@click.command()
@click.option(
    "--requests", "n_requests", default=400, show_default=True, help="Number of synthetic requests."
)
@click.option("--seed", default=0, show_default=True, help="Workload seed.")
@click.option("--block-bytes", default=32 * 1024, show_default=True, help="Bytes of KV per block.")
@click.option(
    "--dir",
    "directory",
    default="tiercache-demo",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where persistent tiers keep their files.",
)
@click.option(
    "--config",
    "config_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Use this TOML config instead of the embedded default.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def demo(
    n_requests: int,
    seed: int,
    block_bytes: int,
    directory: Path,
    config_path: str | None,
    as_json: bool,
) -> None:
    """Run a seeded multi-turn chat + RAG workload and report hit rates and throughput.

    \b
    Example:
      tiercache demo --requests 300 --seed 1
    """
    if n_requests < 1:
        raise click.BadParameter("must be >= 1", param_hint="--requests")
    console = Console(stderr=as_json)
    if config_path is None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    config: Any = config_path or demo_config(directory)
    requests = list(synthetic_requests(n_requests, seed=seed))
    names = ("blocks", "hit_blocks", "stored_bytes", "loaded_bytes", "verified", "mismatched")
    totals = dict.fromkeys(names, 0)
    t_cache = 0.0
    longest = max(len(r.tokens) for r in requests) // 16 + 1
    buf = torch.empty((longest, block_bytes), dtype=torch.uint8)
    with TierCache.open(config, block_bytes=block_bytes) as cache:
        progress = progress_bar("demo", console, transient=as_json)
        with progress:
            task = progress.add_task("requests", total=len(requests))
            for req in requests:
                t0 = time.perf_counter()
                keys = cache.hash_tokens(req.tokens)
                if not keys:
                    progress.advance(task)
                    continue
                got = cache.get(keys, out=buf[: len(keys)])
                k = got.shape[0]
                t_cache += time.perf_counter() - t0
                # What the engine would hold after prefill: loaded hits + newly computed blocks.
                expected = block_bytes_for(keys, block_bytes)
                if k:
                    same = (got == expected[:k]).all(dim=1)
                    totals["verified"] += int(same.sum())
                    totals["mismatched"] += int((~same).sum())
                t0 = time.perf_counter()
                cache.put(keys, expected)
                t_cache += time.perf_counter() - t0
                totals["blocks"] += len(keys)
                totals["hit_blocks"] += k
                totals["loaded_bytes"] += k * block_bytes
                totals["stored_bytes"] += (len(keys) - k) * block_bytes
                progress.advance(task)
        stats = cache.stats()
        cache.take_events()
    bw = memcpy_gbps()
    moved = totals["loaded_bytes"] + totals["stored_bytes"]
    result = {
        "requests": len(requests),
        **totals,
        "hit_rate": totals["hit_blocks"] / max(totals["blocks"], 1),
        "cache_seconds": t_cache,
        "cache_gbps": moved / max(t_cache, 1e-9) / 1e9,
        "block_ops_per_s": totals["blocks"] * 2 / max(t_cache, 1e-9),
        "memcpy_gbps_same_run": bw,
        "tiers": stats,
    }
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    table = Table(title=f"tiercache demo: {len(requests)} requests, {block_bytes} B blocks")
    for col in ("tier", "kind", "blocks", "used", "hits", "miss", "hit%", "stored", "evict", "err"):
        table.add_column(col, justify="left" if col in ("tier", "kind") else "right")
    for medium, s in stats.items():
        asked = s["hits"] + s["misses"]
        head = [str(s[c]) for c in ("capacity_blocks", "used_blocks", "hits", "misses")]
        tail = [str(s[c]) for c in ("stored", "evictions", "errors")]
        hit = f"{s['hits'] / asked:.1%}" if asked else "-"
        table.add_row(medium, s["kind"], *head, hit, *tail)
    console.print(table)
    summary = Table(show_header=False, title="totals")
    summary.add_row(
        "blocks asked / served from cache",
        f"{totals['blocks']} / {totals['hit_blocks']} ({result['hit_rate']:.1%})",
    )
    summary.add_row(
        "bytes loaded / stored",
        f"{totals['loaded_bytes'] / 2**20:.1f} MiB / {totals['stored_bytes'] / 2**20:.1f} MiB",
    )
    summary.add_row(
        "blocks verified byte-exact / mismatched", f"{totals['verified']} / {totals['mismatched']}"
    )
    summary.add_row("time in cache calls", f"{t_cache:.2f} s")
    summary.add_row("cache throughput (bytes moved)", f"{result['cache_gbps']:.2f} GB/s")
    summary.add_row(
        "memcpy bandwidth, same run",
        f"{bw:.2f} GB/s (cache = {result['cache_gbps'] / bw:.2f}x memcpy)",
    )
    console.print(summary)
    if totals["mismatched"]:
        raise click.ClickException(f"{totals['mismatched']} blocks came back wrong")
