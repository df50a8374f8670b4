"""The progress bar of the long CLI commands (`verify`, `demo`): count done and time taken."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["progress_bar"]


def progress_bar(label: str, out: Console, *, transient: bool, disable: bool = False) -> Progress:
    """A bar with the count done and the time taken, labelled `label` (rich markup)."""
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=transient,
        disable=disable,
    )
