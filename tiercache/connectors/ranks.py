"""Tensor and data parallelism: each rank's config, paths and telemetry.

Primitives (each maps the user's config mapping; `resolve_rank_config` applies them):
`per_rank_config` (TP ranks hash the same block keys but keep their shards in stores of their
own), `per_dp_rank_config` (DP ranks, and replicas given a rank, share the shared tiers; each
NVMe tier opens an instance of its own, so a restarted rank finds its blocks again),
`with_nvme_siblings` (head shards: every rank also reads the other instances) and
`per_rank_telemetry`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.config import CacheConfig, split_addr
from tiercache.connectors.namespace import map_tiers, resolve_config, user_prefixed
from tiercache.errors import ConfigError

log = logging.getLogger("tiercache.connectors.common")  # the adapters' helpers' one logger


def _check_rank(axis: str, rank: int, size: int) -> None:
    """ValueError unless `rank` is one of `size` ranks (`axis`: "tp" or "dp")."""
    if not (isinstance(size, int) and isinstance(rank, int) and 0 <= rank < size):
        raise ValueError(
            f"expected 0 <= {axis}_rank < {axis}_size, got {axis}_rank={rank!r}, "
            f"{axis}_size={size!r}"
        )


def rank_suffix(tp_rank: int, tp_size: int) -> str:
    """``tp{rank}of{size}``: the subdirectory / key-prefix suffix of one TP rank's store."""
    _check_rank("tp", tp_rank, tp_size)
    return f"tp{tp_rank}of{tp_size}"


_REDIS_DEFAULT_PREFIX = "tiercache:"  # tiers.redis's default `prefix`


def per_rank_config(user: Mapping[str, Any], *, tp_rank: int, tp_size: int) -> dict[str, Any]:
    """The user's config mapping for TP rank `tp_rank` of `tp_size`: each tier's `path` gets
    a ``tp{rank}of{size}`` subdirectory and each Redis tier's `prefix` that suffix, so ranks
    never share a store file, an LMDB environment or a Redis key space. Unchanged with
    `tp_size` 1 (TP=1 stores stay where they were)."""
    suffix = rank_suffix(tp_rank, tp_size)
    if tp_size == 1:
        return dict(user)

    def rank_tier(_: int, t: Any) -> list[Any]:
        if not isinstance(t, Mapping):
            return [t]
        t = dict(t)
        path = t.get("path")
        if isinstance(path, str | Path) and str(path):
            t["path"] = str(Path(path).expanduser() / suffix)
        if t.get("kind") == "redis":
            prefix = t.get("prefix", _REDIS_DEFAULT_PREFIX)
            if isinstance(prefix, str):
                t["prefix"] = f"{prefix}{suffix}:"
        return [t]

    return map_tiers(user, rank_tier)


def per_dp_rank_config(
    user: Mapping[str, Any],
    *,
    dp_rank: int,
    dp_size: int,
    setter: str = "the data-parallel rank",
) -> dict[str, Any]:
    """The user's config mapping for data-parallel rank `dp_rank` of `dp_size` engines on one
    host: every NVMe tier gets ``instance = dp_rank`` (tiers/nvme/layout.py: rank 0 opens the
    path itself, rank r > 0 ``path/instance{r}``); the ranks share everything else. Unchanged
    with `dp_size` 1. ConfigError when the user set an NVMe tier's `instance` or
    `instance_env` (the rank decides it; `setter` names what sets it in that message)."""
    _check_rank("dp", dp_rank, dp_size)
    if dp_size == 1:
        return dict(user)

    def dp_tier(i: int, t: Any) -> list[Any]:
        if not isinstance(t, Mapping) or t.get("kind") != "nvme":
            return [t]
        for opt in ("instance", "instance_env"):
            if opt in t:
                raise ConfigError(
                    f"tiers[{i}].{opt}",
                    f"{setter} sets the instance ({dp_size} ranks); leave it out",
                )
        return [{**t, "instance": dp_rank}]

    return map_tiers(user, dp_tier)


def per_rank_telemetry(
    user: Mapping[str, Any], *, tp_rank: int, tp_size: int, dp_rank: int = 0, dp_size: int = 1
) -> dict[str, Any]:
    """The user's config mapping with the `[telemetry]` of one rank (a process with a cache
    of its own): its files in `dir/tp{t}of{n}` (`dp{r}of{m}`, `tp{t}of{n}-dp{r}of{m}`), and
    Prometheus on the configured port + dp_rank * tp_size + tp_rank (a port of 0 stays 0), so
    ranks neither overwrite each other's files nor take one port. One rank: unchanged."""
    m = dict(user)
    tel = m.get("telemetry")
    if (tp_size == 1 and dp_size == 1) or not isinstance(tel, Mapping):
        return m  # (a malformed table: resolve_config reports the problem)
    parts = [rank_suffix(tp_rank, tp_size)] if tp_size > 1 else []
    if dp_size > 1:
        parts.append(f"dp{dp_rank}of{dp_size}")
    tel = dict(tel)
    d = tel.get("dir")
    if isinstance(d, str | Path) and str(d):
        tel["dir"] = str(Path(d).expanduser() / "-".join(parts))
    prom = tel.get("prometheus")
    if prom is not None:
        try:
            host, port = split_addr(prom, "telemetry.prometheus")
        except ConfigError:
            pass  # resolve_config reports it
        else:
            if port:
                tel["prometheus"] = f"{host}:{port + dp_rank * tp_size + tp_rank}"
    m["telemetry"] = tel
    return m


@dataclass(frozen=True)
class RankConfig:
    """One TP rank's view: `config` is its own store; `key_namespace` is what block keys are
    hashed with, the same on every rank and in the scheduler (TP size, not rank)."""

    config: CacheConfig
    key_namespace: str
    tp_rank: int
    tp_size: int
    dp_rank: int = 0
    dp_size: int = 1
    shared: bool = False  # head shards: the ranks share the user's paths


def resolve_rank_config(
    user: Mapping[str, Any],
    *,
    block_size: int,
    key_namespace: str,
    store_namespace: str,
    tp_rank: int,
    tp_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    shared: bool = False,
) -> RankConfig:
    """`resolve_config` for one TP rank of one data-parallel rank: `store_namespace` names the
    rank's store, `key_namespace` the keys (a namespace the user gives prefixes both). The
    mapping goes through `per_rank_config`, `per_rank_telemetry` and `per_dp_rank_config`;
    with `shared` (head shards) every TP rank uses the paths as given, and each (DP, TP) rank
    opens an NVMe instance of its own and reads the others' (`with_nvme_siblings`)."""
    mapping = dict(user) if shared else per_rank_config(user, tp_rank=tp_rank, tp_size=tp_size)
    mapping = per_rank_telemetry(
        mapping, tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size
    )
    # NVMe instances: one per DP rank, or (shared paths) one per (DP, TP) rank.
    instance, instances = (
        (dp_rank * tp_size + tp_rank, dp_size * tp_size) if shared else (dp_rank, dp_size)
    )
    setter = "the (data-parallel, tensor-parallel) rank" if shared else "the data-parallel rank"
    mapping = per_dp_rank_config(mapping, dp_rank=instance, dp_size=instances, setter=setter)
    if shared:
        mapping = with_nvme_siblings(mapping)
    config = resolve_config(mapping, block_size=block_size, namespace=store_namespace)
    keys = user_prefixed(user, key_namespace)
    return RankConfig(config, keys, tp_rank, tp_size, dp_rank, dp_size, shared)


def with_nvme_siblings(user: Mapping[str, Any]) -> dict[str, Any]:
    """The user's config mapping with, right below each NVMe tier, an ``nvme-siblings``
    tier of the same path (named ``{name}-siblings``): the other instances there, read-only
    (tiers/nvme/siblings.py), where a rank finds shards written at another TP size. The
    siblings tier skips the NVMe tier's `instance` (0 without one; with `instances` or
    `instance_env`, whichever this process holds)."""

    def and_siblings(_: int, t: Any) -> list[Any]:
        path = t.get("path") if isinstance(t, Mapping) and t.get("kind") == "nvme" else None
        if not isinstance(path, str | Path) or not str(path):
            return [t]
        sib = {"kind": "nvme-siblings", "name": f"{t.get('name', 'nvme')}-siblings"}
        sib |= {"path": str(path), "blocks": 1}
        own = t.get("instance", None if {"instances", "instance_env"} & set(t) else 0)
        return [t, sib if own is None else {**sib, "instance": own}]

    return map_tiers(user, and_siblings)


def prepare_rank_dirs(rank: RankConfig) -> None:
    """With several ranks, create (0700) the directory the per-rank paths live in (the path
    the user gave), as a tier does its own with one rank: only where its parent exists."""
    parents = []
    if rank.tp_size > 1 and not rank.shared:
        suffix = rank_suffix(rank.tp_rank, rank.tp_size)
        for t in rank.config.tiers:
            path = t.options.get("path")
            if isinstance(path, str) and Path(path).name == suffix:
                parents.append(Path(path).parent)
    tel = rank.config.telemetry
    if tel is not None and (rank.tp_size > 1 or rank.dp_size > 1):
        parents.append(Path(tel.dir).parent)
    for parent in parents:
        if not parent.exists() and parent.parent.is_dir():
            try:
                parent.mkdir(mode=0o700)
            except FileExistsError:  # another rank made it meanwhile
                pass
            except OSError as exc:
                log.warning("cannot create %s for the per-rank paths: %s", parent, exc)
