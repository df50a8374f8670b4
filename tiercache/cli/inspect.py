"""`tiercache inspect`: what each tier of a config (or one store directory) holds on disk.

Read-only: the NVMe store is read without its lock (a running engine keeps it), the LMDB store
through a read-only environment (a read transaction beside the engine's). Nothing in a store
changes.
"""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from tiercache.cli._common import JSON, TARGET, TIERS, console, echo_json, human_bytes, lmdb_errors
from tiercache.cli._common import when as _when
from tiercache.cli._store import inspect_store, known_names, resolve


@click.command()
@TARGET
@TIERS
@click.option(
    "--namespace",
    "namespaces",
    multiple=True,
    metavar="NAME",
    help="A namespace to show by name (stores keep only a 64-bit id of it; repeatable).",
)
@JSON
@lmdb_errors
def inspect(
    target: str, tiers: tuple[str, ...], namespaces: tuple[str, ...], as_json: bool
) -> None:
    """Show each tier: kind, path, capacity, used, blocks, bytes, compression ratio,
    namespaces present, format version, oldest/newest write. Never modifies a store; works
    while an engine has it open.

    CONFIG_OR_PATH is a TOML config or a store directory (an nvme or lmdb path).

    \b
    Examples:
      tiercache inspect cache.toml
      tiercache inspect /mnt/nvme/tiercache --json
    """
    tgt = resolve(target)
    if not tgt.tiers:
        raise ValueError(f"{target} is a telemetry directory; use `tiercache stats` on it")
    names = known_names(tgt, namespaces)
    picked = set(tiers) or None
    if picked is not None:
        tgt.stores(tiers)  # unknown names fail here, with the tiers that exist
    rows = [inspect_store(r, names) for r in tgt.tiers if picked is None or r.name in picked]
    if as_json:
        echo_json({"source": tgt.source, "tiers": rows})
        return
    out = console(False)
    for row in rows:
        out.print(_table(row))


def _table(r: dict[str, Any]) -> Table:
    t = Table(title=f"{r['name']} ({r['kind']})", show_header=False, title_justify="left")
    t.add_column("field", style="bold")
    t.add_column("value")
    t.add_row("path", r["path"] or "-")
    if "note" in r:
        t.add_row("note", r["note"])
    if "capacity_bytes" in r and r.get("format") is None:
        cap = r["capacity_blocks"] or human_bytes(r["capacity_bytes"])
        t.add_row("capacity", f"{cap}")
    if r.get("format") is None:
        return t
    cap = r["capacity_blocks"]
    t.add_row("format", r["format"])
    t.add_row("block size", human_bytes(r["block_bytes"]))
    t.add_row(
        "capacity",
        "unknown (give the config)" if cap is None else f"{cap} blocks",
    )
    used = f"{r['used_blocks']} blocks"
    if cap:
        used += f" ({r['used_blocks'] / cap:.1%})"
    t.add_row("used", used)
    t.add_row(
        "bytes",
        f"{human_bytes(r['raw_bytes'])} of blocks, {human_bytes(r['stored_bytes'])} stored, "
        f"{human_bytes(r['file_bytes'])} on disk",
    )
    t.add_row("compression", f"{r['compression_ratio']:.2f}x")
    ns = r["namespaces"]
    t.add_row("namespaces", ", ".join(f"{k}: {v}" for k, v in ns.items()) or "-")
    t.add_row(
        "writes (seq)",
        "-" if r["oldest_seq"] is None else f"oldest {r['oldest_seq']}, newest {r['newest_seq']}",
    )
    t.add_row("last modified", _when(r["last_modified"]))
    held = "no"
    if r["in_use"]:
        held = "yes" + (f" (pid {r['holder_pid']})" if r.get("holder_pid") else "")
    t.add_row("open elsewhere", held)
    bad = r["unreadable_entries"] + r.get("index_damaged_records", 0)
    t.add_row("unreadable entries", f"{bad} (run `tiercache verify`)" if bad else "0")
    return t
