"""Helpers shared by the store commands: options, output, confirmation, error mapping."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from tiercache.errors import StoreError

F = TypeVar("F", bound=Callable[..., Any])

TARGET = click.argument("target", metavar="CONFIG_OR_PATH", type=click.Path(path_type=str))
JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
TIERS = click.option(
    "--tier",
    "tiers",
    multiple=True,
    metavar="NAME",
    help="Only this tier of a config (repeatable; default: every persistent tier).",
)


def lmdb_errors(fn: F) -> F:
    """LMDB's own errors become one-line store errors (the group prints those)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import lmdb

        try:
            return fn(*args, **kwargs)
        except lmdb.Error as exc:
            raise StoreError(f"LMDB: {exc}") from None

    return wrapper  # type: ignore[return-value]


def store_command(*options: Callable[[Any], Any]) -> Callable[[F], click.Command]:
    """A store command: CONFIG_OR_PATH, --tier, `options`, --json (in that order in --help),
    LMDB's errors as store errors."""

    def make(fn: F) -> click.Command:
        for decorate in reversed((TARGET, TIERS, *options, JSON, lmdb_errors)):
            fn = decorate(fn)
        return click.command()(fn)

    return make


def console(as_json: bool) -> Console:
    """People's output on stdout; with --json it goes to stderr and stdout holds the JSON."""
    return Console(stderr=as_json, highlight=False, soft_wrap=True)  # lines stay whole


def echo_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, default=_json_default))


def _json_default(o: Any) -> Any:
    if isinstance(o, bytes):
        return o.hex()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def when(ts: float | None) -> str:
    """A local timestamp with its age, e.g. '2026-11-22 08:01:02 (3s ago)'."""
    if ts is None:
        return "-"
    age = max(0.0, time.time() - ts)
    ago = f"{age:.0f}s" if age < 120 else f"{age / 60:.0f}m" if age < 7200 else f"{age / 3600:.1f}h"
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ts))} ({ago} ago)"


def confirm(question: str, yes: bool) -> None:
    """Ask on stderr unless --yes; click.Abort (exit 1, 'Aborted!') on no."""
    if not yes:
        click.confirm(question, abort=True, err=True)


def kv_groups_table(section: dict[str, Any]) -> Table:
    """The KV connector's `kv_groups` telemetry section: per KV cache group its kind, layers,
    window, bytes per block, blocks kept and bytes per token stored; the caption names the
    block layout across TP sizes (head shards, or one store per rank)."""
    lay = section.get("tp_layout") or {}
    if lay.get("layout") == "heads":
        o = lay.get("owned_shards") or ["?", "?"]
        where = f"; {lay.get('shards')} head shards per block, TP rank {lay.get('tp_rank')} "
        where += f"of {lay.get('tp_size')} holds shards {o[0]}-{o[-1]}"
    elif lay:
        where = f"; one store per TP rank (TP {lay.get('tp_size')})"
    else:
        where = ""
    t = Table(
        title="KV cache groups",
        caption=(
            f"blocks of {section.get('block_size', '?')} tokens; "
            f"{section.get('kept_tokens', 0)} tokens stored{where}"
        ),
        title_justify="left",
    )
    for c in ("group", "kind", "layers", "window", "block", "kept", "bytes/token"):
        t.add_column(c, justify="left" if c == "kind" else "right", no_wrap=True)
    for g in section.get("groups", ()):
        bpt = g.get("bytes_per_token")
        t.add_row(
            str(g["group"]),
            str(g["kind"]).replace("_attention", "").replace("_window", ""),
            str(g["layers"]),
            str(g["window_blocks"]) if g.get("window_blocks") else "-",
            human_bytes(g["block_bytes"]),
            str(g["kept_blocks"]),
            "-" if bpt is None else f"{bpt:,.1f}",
        )
    return t
