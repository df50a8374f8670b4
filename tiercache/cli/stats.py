"""`tiercache stats`: the live counters of a running engine, or what a store holds on disk.

Sources, by what CONFIG_OR_PATH names:
- a config with a `[telemetry]` table, or a telemetry directory: the engine's last
  `stats.json` (rewritten every `interval` seconds; see `tiercache.telemetry`); with tensor or
  data parallelism each rank writes its own under the directory (`tp0of2`, `dp1of2`, ...),
  and every rank's is shown;
- an `http://host:port/...` URL: the engine's Prometheus endpoint (`telemetry.prometheus`);
- a config without telemetry, or a store directory: per store, blocks, bytes and
  namespaces read from disk (read-only, as `inspect`).
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from typing import Any

from rich.table import Table

from tiercache.cli.common import (
    console,
    echo_json,
    human_bytes,
    kv_groups_table,
    store_command,
    when,
)
from tiercache.cli.stores import inspect_store, known_names, rank_dirs, resolve
from tiercache.telemetry import read_stats
from tiercache.tiers.lmdb.attach import pid_alive

_COUNTERS = ("hits", "misses", "stored", "evictions", "errors")  # all of them: --json


@store_command()
def stats(target: str, tiers: tuple[str, ...], as_json: bool) -> None:
    """Show the live counters of a running engine (its telemetry stats file or Prometheus
    endpoint) or, for a store on disk, its blocks, bytes and namespaces.

    CONFIG_OR_PATH is a TOML config, a store directory (an nvme or lmdb path), a telemetry
    directory, or the http:// URL of the engine's Prometheus endpoint.

    \b
    Examples:
      tiercache stats cache.toml
      tiercache stats /run/tiercache/engine0 --json
      tiercache stats http://127.0.0.1:9464/metrics
    """
    if target.startswith(("http://", "https://")):
        doc = _from_prometheus(target)
    else:
        doc = _from_target(target, tiers)
        if tiers and doc["source"] != "disk":
            for one in doc.get("ranks", {}).values() or [doc]:
                missing = [t for t in tiers if t not in one["tiers"]]
                if missing:
                    raise ValueError(f"--tier: no tier named {missing[0]!r} in the engine's stats")
                one["tiers"] = {k: v for k, v in one["tiers"].items() if k in tiers}
    if as_json:
        echo_json(doc)
        return
    _show(doc)


def _from_target(target: str, tiers: tuple[str, ...]) -> dict[str, Any]:
    """The stats of a config or directory: its engine's telemetry (every rank's, with
    tensor or data parallelism), else what its persistent stores hold on disk."""
    ranks = rank_dirs(target) if os.path.isdir(target) else []
    if not ranks:
        tgt = resolve(target)
        if tgt.telemetry_dir is None:
            stores = tgt.stores(tiers)
            if not stores:
                raise ValueError(
                    f"{target}: no telemetry configured and no persistent tier to read; "
                    "add a [telemetry] table to the config"
                )
            names = known_names(tgt)
            return {"source": "disk", "tiers": {s.label: inspect_store(s, names) for s in stores}}
        ranks = rank_dirs(tgt.telemetry_dir)
        if not ranks:
            return _from_telemetry(tgt.telemetry_dir)
    return {
        "source": "telemetry",
        "dir": os.path.dirname(ranks[0]),
        "ranks": {os.path.basename(r): _from_telemetry(r) for r in ranks},
    }


def _from_telemetry(directory: str) -> dict[str, Any]:
    doc = read_stats(directory)
    age = time.time() - doc["updated"]
    if doc.get("closed"):
        state = "closed"
    elif not pid_alive(doc["pid"], None):
        state = "dead"  # the process ended without closing the cache
    elif age > 3 * doc["interval"] + 5:
        state = "stale"
    else:
        state = "running"
    return {"source": "telemetry", "dir": directory, "state": state, **doc}


def _from_prometheus(url: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise OSError(f"{url}: cannot fetch metrics: {getattr(exc, 'reason', exc)}") from None
    tiers: dict[str, dict[str, Any]] = {}
    try:
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith("tiercache_tier_"):
                continue
            field = fam.name.removeprefix("tiercache_tier_")
            for s in fam.samples:
                if s.name.endswith("_created") or "tier" not in s.labels:
                    continue
                tiers.setdefault(s.labels["tier"], {})[field] = int(s.value)
    except ValueError as exc:
        raise ValueError(f"{url}: not Prometheus text format: {exc}") from None
    if not tiers:
        raise ValueError(f"{url}: no tiercache_tier_* metrics there")
    return {"source": "prometheus", "url": url, "tiers": tiers}


def _show(doc: dict[str, Any]) -> None:
    out = console(False)
    if "ranks" in doc:  # one engine process per rank, each with its own stats
        for name, one in doc["ranks"].items():
            out.print(f"[bold]rank {name}[/bold] ({one['dir']})")
            _show(one)
        return
    if doc["source"] == "disk":
        t = Table(title="stores on disk (no running engine's telemetry configured)")
        for c in ("tier", "kind", "blocks", "capacity", "stored", "ratio", "namespaces", "open"):
            t.add_column(c, justify="left" if c in ("tier", "kind", "namespaces") else "right")
        for name, r in doc["tiers"].items():
            if r.get("format") is None:
                t.add_row(name, r["kind"], "-", "-", "-", "-", r.get("note", ""), "-")
                continue
            t.add_row(
                name,
                r["kind"],
                str(r["blocks"]),
                str(r["capacity_blocks"] or "-"),
                human_bytes(r["stored_bytes"]),
                f"{r['compression_ratio']:.2f}x",
                ", ".join(f"{k}: {v}" for k, v in r["namespaces"].items()) or "-",
                "yes" if r["in_use"] else "no",
            )
        out.print(t)
        return
    if doc["source"] == "telemetry":
        out.print(
            f"engine pid {doc['pid']} [bold]{doc['state']}[/bold], updated {when(doc['updated'])}, "
            f"namespace {doc['namespace']!r}, blocks of {human_bytes(doc['block_bytes'])}"
        )
    else:
        out.print(f"engine metrics from {doc['url']}")
    t = Table()
    cols = ["tier", "kind", "used", "hit%", *_COUNTERS]
    for c in cols:
        t.add_column(c, justify="left" if c in ("tier", "kind") else "right")
    for name, s in doc["tiers"].items():
        asked = s.get("hits", 0) + s.get("misses", 0)
        t.add_row(
            name,
            s.get("kind", "-"),
            f"{s.get('used_blocks', '-')}/{s.get('capacity_blocks', '-')}",
            f"{s['hits'] / asked:.1%}" if asked else "-",
            *(str(s.get(c, "-")) for c in _COUNTERS),
        )
    out.print(t)
    if doc.get("kv_groups"):
        out.print(kv_groups_table(doc["kv_groups"]))
