"""`tiercache evict` and `tiercache clear`: drop blocks from the persistent stores.

Both list what they would drop and ask first (`--yes` skips the question). `--namespace`
scopes them to one namespace (its name as in the config, or `id:<hex>` as inspect prints
it). An NVMe store must be closed (its index lives in the owning process); an LMDB store may
be open in a running engine, which then reads the dropped blocks as misses.
"""

from __future__ import annotations

from typing import Any

import click

from tiercache.cli.common import confirm, console, echo_json, store_command
from tiercache.cli.stores import (
    StoreRef,
    check_owner_free,
    drop_blocks,
    list_blocks,
    parse_namespace,
    resolve,
)
from tiercache.tiers.offline import BlockInfo

NAMESPACE = click.option(
    "--namespace",
    default=None,
    metavar="NAME",
    help="Only blocks of this namespace (the config's string, or id:<16 hex> from inspect).",
)
YES = click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")


def _parse_key(value: str) -> bytes:
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) != 16:
        raise ValueError(f"--key: {value!r} is not a block key (32 hex digits)")
    return key


def _plan(
    target: str, tiers: tuple[str, ...], namespace: str | None, choose: Any
) -> list[tuple[StoreRef, list[BlockInfo], int]]:
    """Per store: the victims `choose(blocks in scope, oldest first)` picks, and how many
    blocks the store holds."""
    ns = parse_namespace(namespace) if namespace is not None else None
    stores = resolve(target).stores(tiers)
    if not stores:
        raise ValueError(f"{target}: no persistent tier to change")
    for s in stores:
        check_owner_free(s)
    plan = []
    for s in stores:
        held = list_blocks(s)
        plan.append((s, choose([b for b in held if ns is None or b.namespace == ns]), len(held)))
    return plan


def _apply(
    plan: list[tuple[StoreRef, list[BlockInfo], int]], verb: str, yes: bool, as_json: bool
) -> None:
    out = console(as_json)
    total = sum(len(v) for _, v, _ in plan)
    if total == 0:
        if as_json:
            echo_json({"dropped": {s.label: 0 for s, _, _ in plan}})
        else:
            out.print(f"nothing to {verb}")
        return
    for s, victims, held in plan:
        out.print(f"{s.label} ({s.kind}) {s.path}: {verb} {len(victims)} of {held} blocks")
    confirm(f"{verb.capitalize()} {total} blocks?", yes)
    dropped = {s.label: drop_blocks(s, victims) for s, victims, _ in plan}
    if as_json:
        echo_json({"dropped": dropped})
    else:
        for name, n in dropped.items():
            out.print(f"{name}: {n} blocks dropped")


@store_command(
    NAMESPACE,
    click.option("--oldest", type=click.IntRange(min=1), default=None, help="Drop the N oldest."),
    click.option("--keep", type=click.IntRange(min=0), default=None, help="Keep the N newest."),
    click.option(
        "--key", "keys", multiple=True, metavar="HEX", help="Drop this block (repeatable)."
    ),
    YES,
)
def evict(
    target: str,
    tiers: tuple[str, ...],
    namespace: str | None,
    oldest: int | None,
    keep: int | None,
    keys: tuple[str, ...],
    yes: bool,
    as_json: bool,
) -> None:
    """Drop blocks from the persistent stores: the N oldest writes (--oldest), all but the
    N newest (--keep), or given keys (--key); per store, within --namespace if given.

    CONFIG_OR_PATH is a TOML config or a store directory (an nvme or lmdb path).

    \b
    Examples:
      tiercache evict cache.toml --oldest 1000
      tiercache evict /var/cache/tiercache/lmdb --keep 500 --namespace llama-3-8b/bf16 --yes
    """
    given = sum(x is not None and x != () for x in (oldest, keep, keys))
    if given != 1:
        raise ValueError("evict: give exactly one of --oldest N, --keep N or --key HEX")
    wanted = {_parse_key(k) for k in keys}

    def choose(scope: list[BlockInfo]) -> list[BlockInfo]:  # scope is oldest first
        if oldest is not None:
            return scope[:oldest]
        if keep is not None:
            return scope[: max(0, len(scope) - keep)]
        return [b for b in scope if b.key in wanted]

    _apply(_plan(target, tiers, namespace, choose), "evict", yes, as_json)


@store_command(NAMESPACE, YES)
def clear(
    target: str, tiers: tuple[str, ...], namespace: str | None, yes: bool, as_json: bool
) -> None:
    """Drop every block of the persistent stores (or of one --namespace).

    CONFIG_OR_PATH is a TOML config or a store directory (an nvme or lmdb path).

    \b
    Examples:
      tiercache clear cache.toml
      tiercache clear /mnt/nvme/tiercache --namespace id:9f3c2a1b7e5d4c60 --yes
    """
    _apply(_plan(target, tiers, namespace, lambda scope: scope), "clear", yes, as_json)
