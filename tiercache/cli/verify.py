"""`tiercache verify [--repair]`: read every persisted block and check it.

Checks, per NVMe store: the slab's size, the index journal (damaged records, slots beyond the
capacity) and, for every block the index names, the slot's header (key, write sequence,
length, codec) and the checksum over header and payload. Per LMDB store: every header
(key, length, codec), every payload's checksum and decompression, and entries with a header
but no payload or the other way round.

Exit status: 0 clean (or repaired clean), 1 problems remain, 2 an error.
"""

from __future__ import annotations

import os
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from tiercache.cli.common import console, echo_json, store_command
from tiercache.cli.progress import progress_bar
from tiercache.cli.stores import VerifyReport, count_blocks, repair_store, resolve, verify_store


@store_command(
    click.option(
        "--repair",
        is_flag=True,
        help="Drop the bad entries (needs the NVMe store closed), then verify again.",
    ),
    click.option("--no-progress", is_flag=True, help="No progress bar on stderr."),
)
def verify(
    target: str, tiers: tuple[str, ...], repair: bool, no_progress: bool, as_json: bool
) -> None:
    """Read every persisted block, check checksums and index consistency, print what is
    wrong; with --repair drop the bad entries. Exit 1 when problems remain.

    CONFIG_OR_PATH is a TOML config or a store directory (an nvme or lmdb path).

    \b
    Examples:
      tiercache verify cache.toml
      tiercache verify /mnt/nvme/tiercache --repair
    """
    tgt = resolve(target)
    stores = tgt.stores(tiers)
    if not stores:
        raise ValueError(f"{target}: no persistent tier to verify")
    out = console(as_json)
    reports = _run(stores, disable=no_progress)
    dropped: dict[str, int] = {}
    if repair and any(r.problems for r in reports):
        for rep in reports:
            dropped[rep.ref.label] = repair_store(rep.ref, rep)
        reports = _run(stores, disable=no_progress)
    if as_json:
        echo_json(
            {
                "source": tgt.source,
                "ok": not any(r.problems for r in reports),
                "stores": [_doc(r, dropped.get(r.ref.label)) for r in reports],
            }
        )
    else:
        for rep in reports:
            _show(out, rep, dropped.get(rep.ref.label))
    if any(r.problems for r in reports):
        raise SystemExit(1)


def _run(stores: list[Any], *, disable: bool) -> list[VerifyReport]:
    """Verify each store, with one progress bar over all their blocks on stderr."""
    total = sum(count_blocks(s) for s in stores if s.path and os.path.exists(s.path))
    progress = progress_bar(
        "verify {task.description}", Console(stderr=True), transient=True, disable=disable
    )
    reports = []
    with progress:
        task = progress.add_task("", total=total)
        for s in stores:
            progress.update(task, description=s.label)
            reports.append(verify_store(s, lambda n: progress.advance(task, n)))
    return reports


def _doc(rep: VerifyReport, dropped: int | None) -> dict[str, Any]:
    return {
        "name": rep.ref.label,
        "kind": rep.ref.kind,
        "path": rep.ref.path,
        "checked": rep.checked,
        "ok": not rep.problems,
        "dropped": dropped,
        "notes": rep.notes,
        "problems": [
            {"where": p.where, "what": p.what, "key": p.key.hex() if p.key else None}
            for p in rep.problems
        ],
    }


def _show(out: Any, rep: VerifyReport, dropped: int | None) -> None:
    head = f"{rep.ref.label} ({rep.ref.kind}) {rep.ref.path}: {rep.checked} blocks checked"
    if dropped is not None:
        head += f", {dropped} bad entries dropped"
    for note in rep.notes:
        head += f"; {note}"
    if not rep.problems:
        out.print(f"[green]ok[/green]  {head}")
        return
    out.print(f"[red]BAD[/red] {head}, {len(rep.problems)} problems")
    t = Table("where", "key", "problem")
    for p in rep.problems[:50]:
        t.add_row(p.where, p.key.hex() if p.key else "-", p.what)
    out.print(t)
    if len(rep.problems) > 50:
        out.print(f"... and {len(rep.problems) - 50} more (--json lists all)")
    if dropped is None:
        out.print("run with --repair to drop the bad entries")
