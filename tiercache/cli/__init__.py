"""The `tiercache` command line: one module per command group.

Errors print as one line on stderr with exit code 2 (no traceback).
"""

from __future__ import annotations

import sys

import click

from tiercache import __version__
from tiercache.cli.bench import bench
from tiercache.cli.demo import demo
from tiercache.cli.events import events
from tiercache.cli.evict import clear, evict
from tiercache.cli.inspect import inspect
from tiercache.cli.stats import stats
from tiercache.cli.verify import verify
from tiercache.errors import TierCacheError


class _Group(click.Group):
    """A click group that turns tiercache and input errors into one clear line."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (TierCacheError, ValueError, TypeError, OSError) as exc:
            click.echo(f"tiercache: error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tiercache")
def main() -> None:
    """tiercache: a tiered KV-cache storage engine for LLM serving.

    \b
    Example:
      tiercache demo --requests 300
    """


for _cmd in (demo, bench, inspect, verify, stats, events, evict, clear):
    main.add_command(_cmd)
