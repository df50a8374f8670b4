"""`tiercache inspect`: what each tier of a config (or one store directory) holds on disk.

Read-only: the NVMe store is read without its lock (a running engine keeps it), the LMDB store
through a read-only environment (a read transaction beside the engine's). Nothing in a store
changes.
"""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from tiercache.cli.common import (
    console,
    echo_json,
    human_bytes,
    kv_groups_table,
    store_command,
    when,
)
from tiercache.cli.stores import inspect_store, known_names, resolve
from tiercache.telemetry import read_stats


@store_command(
    click.option(
        "--namespace",
        "namespaces",
        multiple=True,
        metavar="NAME",
        help="A namespace to show by name (stores keep only a 64-bit id of it; repeatable).",
    ),
    click.option(
        "--redis-scan",
        is_flag=True,
        help="Count keys per namespace on Redis tiers with SCAN (O(keys in the database)).",
    ),
)
def inspect(
    target: str,
    tiers: tuple[str, ...],
    namespaces: tuple[str, ...],
    redis_scan: bool,
    as_json: bool,
) -> None:
    """Show each tier: kind, path, capacity, used, blocks, bytes, compression ratio,
    namespaces present, format version, oldest/newest write. Never modifies a store; works
    while an engine has it open. With a [telemetry] table in the config, also the KV cache
    groups the engine's connector reported: bytes per token each group stores.

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
    ns = tgt.config.namespace if tgt.config else None
    rows = [
        inspect_store(r, names, namespace=ns, redis_scan=redis_scan)
        for r in tgt.tiers
        if picked is None or r.name in picked
    ]
    groups = _kv_groups(tgt.telemetry_dir)
    if as_json:
        doc: dict[str, Any] = {"source": tgt.source, "tiers": rows}
        if groups is not None:
            doc["kv_groups"] = groups
        echo_json(doc)
        return
    out = console(False)
    for row in rows:
        out.print(_table(row))
    if groups is not None:
        out.print(kv_groups_table(groups))


def _kv_groups(telemetry_dir: str | None) -> dict[str, Any] | None:
    """What the KV connector reported of its KV cache groups (bytes per token each stores)
    in the engine's last telemetry stats, where the config has telemetry; the store itself
    keeps only hashed keys, which name no group."""
    if telemetry_dir is None:
        return None
    try:
        doc = read_stats(telemetry_dir)
    except (OSError, ValueError):  # no engine has written stats there yet
        return None
    section = doc.get("kv_groups")
    return {**section, "updated": doc.get("updated")} if section else None


def _table(r: dict[str, Any]) -> Table:
    name = r["name"] + (f"/instance{r['instance']}" if r.get("instance") else "")
    t = Table(title=f"{name} ({r['kind']})", show_header=False, title_justify="left")
    t.add_column("field", style="bold")
    t.add_column("value")
    t.add_row("path", r["path"] or "-")
    if "note" in r:
        t.add_row("note", r["note"])
    if r["kind"] == "redis":
        return _redis_rows(t, r)
    if "capacity_bytes" in r and r.get("format") is None:
        cap = r["capacity_blocks"] or human_bytes(r["capacity_bytes"])
        t.add_row("capacity", f"{cap}")
    if r.get("format") is None:
        return t
    cap = r["capacity_blocks"]
    t.add_row("format", r["format"])
    t.add_row("block size", human_bytes(r["block_bytes"]))
    if cap is not None:
        t.add_row("capacity", f"{cap} blocks")
    elif any(u["capacity_blocks"] for u in r.get("namespace_usage", ())):
        t.add_row("capacity", "per namespace (below)")
    else:
        t.add_row("capacity", "unknown (give the config)")
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
    if "namespace_usage" in r:
        t.add_row("namespaces", "\n".join(map(_usage_line, r["namespace_usage"])) or "-")
    else:
        ns = r["namespaces"]
        t.add_row("namespaces", ", ".join(f"{k}: {v}" for k, v in ns.items()) or "-")
    t.add_row(
        "writes (seq)",
        "-" if r["oldest_seq"] is None else f"oldest {r['oldest_seq']}, newest {r['newest_seq']}",
    )
    t.add_row("last modified", when(r["last_modified"]))
    held = "no"
    if r["in_use"]:
        held = "yes" + (f" (pid {r['holder_pid']})" if r.get("holder_pid") else "")
    t.add_row("open elsewhere", held)
    if "attached" in r:
        t.add_row("attached", "\n".join(map(_attach_line, r["attached"])) or "none recorded")
        pids = sorted({x["pid"] for x in r["readers"]})
        t.add_row(
            "reader slots",
            f"{len(r['readers'])} (pids {', '.join(map(str, pids))})" if pids else "0",
        )
    bad = r["unreadable_entries"] + r.get("index_damaged_records", 0)
    t.add_row("unreadable entries", f"{bad} (run `tiercache verify`)" if bad else "0")
    return t


def _usage_line(u: dict[str, Any]) -> str:
    """'ns-a: 12 of 64 blocks (18.8%), 2 attached' (the store's own count when it differs)."""
    cap = u["capacity_blocks"]
    line = f"{u['namespace']}: {u['blocks']}"
    line += f" of {cap} blocks ({u['used']:.1%})" if cap else " blocks (capacity not recorded)"
    if u["counted"] is not None and u["counted"] != u["blocks"]:
        line += f", the store counts {u['counted']}"
    if u["attached"]:
        line += f", {u['attached']} attached"
    return line


def _attach_line(a: dict[str, Any]) -> str:
    """'pid 123 on host, ns-a (64 blocks), since <when>' plus its state when not live."""
    line = f"pid {a['pid']} on {a['host']}, {a['namespace']}"
    if a["capacity_blocks"] is not None:
        line += f" ({a['capacity_blocks']} blocks)"
    line += f", since {when(a['opened_at'])}"
    if a["state"] == "stale":
        line += ", stale (the process is gone)"
    elif a["state"] == "unknown":
        line += ", another host (not checked)"
    return line


def _redis_rows(t: Table, r: dict[str, Any]) -> Table:
    cap = r["capacity_blocks"] or human_bytes(r["capacity_bytes"])
    t.add_row("capacity", f"{cap} (per process, from the config)")
    if "server" not in r:
        return t
    t.add_row("url", f"{r['url']} (prefix {r['prefix']!r})")
    sv = r["server"]
    mm = human_bytes(sv["maxmemory"]) if sv["maxmemory"] else "no limit"
    t.add_row(
        "server",
        f"Redis {sv['version']}, {human_bytes(sv['used_memory'])} used, maxmemory {mm} "
        f"({sv['maxmemory_policy']}), {r['keys_in_db']} keys in the database",
    )
    if "store_meta" in r:
        t.add_row("store metadata", json.dumps(r["store_meta"]) if r["store_meta"] else "none")
    att = r["attached"]
    t.add_row(
        "attached",
        "\n".join(f"{a['addr']} (connected {a['age_s']}s, idle {a['idle_s']}s)" for a in att)
        or "no tiercache connection",
    )
    if "namespaces" in r:
        ns = r["namespaces"]
        t.add_row("namespaces", "\n".join(f"{k}: {v} blocks" for k, v in ns.items()) or "-")
    else:
        t.add_row("namespaces", "not counted (--redis-scan: SCAN, O(keys))")
    return t
