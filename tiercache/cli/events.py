"""`tiercache events`: the stored/removed events of a running engine, from its telemetry
directory (`events.jsonl`, rotated to `events.jsonl.1`), one line per event or JSON lines."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from tiercache.cli.common import JSON, TARGET
from tiercache.cli.stores import resolve
from tiercache.telemetry import follow_events, read_events


@click.command()
@TARGET
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events as they come.")
@click.option(
    "-n",
    "--last",
    default=20,
    show_default=True,
    type=click.IntRange(min=0),
    help="Print this many of the (matching) events already on disk first.",
)
@click.option("--tier", "tiers", multiple=True, metavar="NAME", help="Only this tier (repeatable).")
@click.option(
    "--count",
    type=click.IntRange(min=1),
    default=None,
    help="With --follow: stop after this many new events.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="With --follow: stop after this many seconds.",
)
@click.option("--keys", "show_keys", is_flag=True, help="Print every block key, not the first.")
@JSON
def events(
    target: str,
    follow: bool,
    last: int,
    tiers: tuple[str, ...],
    count: int | None,
    timeout: float | None,
    show_keys: bool,
    as_json: bool,
) -> None:
    """Print the engine's block events (stored / removed, per tier), one line each, or JSON
    lines with --json; --follow waits for new ones (Ctrl-C to stop).

    CONFIG_OR_PATH is a TOML config with a [telemetry] table, or its telemetry directory.

    \b
    Examples:
      tiercache events cache.toml --last 50
      tiercache events /run/tiercache/engine0 --follow --json
    """
    tgt = resolve(target)
    if tgt.telemetry_dir is None:
        raise ValueError(
            f"{target}: no telemetry directory; events come from a running engine whose "
            "config has a [telemetry] table"
        )
    keep = set(tiers)

    def emit(rec: dict[str, Any]) -> bool:
        if keep and rec.get("medium") not in keep:
            return False
        click.echo(json.dumps(rec) if as_json else _line(rec, show_keys))
        return True

    kept = [r for r in read_events(tgt.telemetry_dir) if not keep or r.get("medium") in keep]
    for rec in kept[-last:] if last else []:
        emit(rec)
    if not follow:
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    shown = 0
    try:
        for rec in follow_events(tgt.telemetry_dir, deadline=deadline):
            if emit(rec):
                shown += 1
                if count is not None and shown >= count:
                    return
    except KeyboardInterrupt:
        return


def _line(rec: dict[str, Any], show_keys: bool) -> str:
    t = rec.get("t", 0.0)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
    keys = rec.get("keys", [])
    if show_keys:
        shown = " ".join(keys)
    else:
        shown = (keys[0] if keys else "") + (f" +{len(keys) - 1}" if len(keys) > 1 else "")
    return (
        f"{stamp}  {rec.get('op', '?'):<7}  {rec['medium']:<8}  {rec.get('blocks', 0):>5}  {shown}"
    )
