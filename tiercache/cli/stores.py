"""Offline access to the stores a CONFIG_OR_PATH names, shared by the CLI commands.

Primitives:
- `resolve(target)` -> `Target`: a TOML config (its tiers and telemetry directory), one store
  directory (NVMe: has meta.json; LMDB: has data.mdb) or a telemetry directory (stats.json).
  An NVMe store's instances (``path/instance{k}``, tiers/nvme/layout.py) are stores of their own.
- `inspect_store(ref, names)`: what a store holds, read-only (works beside a running engine).
- `verify_store(ref, advance)`: every block read and checked; `repair_store` drops bad ones.
- `list_blocks(ref)` / `drop_blocks(ref, keys)`: what `evict` and `clear` choose from and drop.

Each store is its kind's `OfflineStore` (tiers/offline.py): read-only paths never take a lock
a running engine needs; dropping blocks from an NVMe store needs it closed (its index lives in
the owner's memory), an LMDB store may stay open elsewhere (it reads dropped blocks as misses).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercache.config import CacheConfig
from tiercache.telemetry import EVENTS_FILE, STATS_FILE
from tiercache.tiers import tier_class
from tiercache.tiers.format import namespace_id
from tiercache.tiers.offline import BlockInfo, OfflineStore, Problem

PERSISTENT_KINDS = ("nvme", "lmdb")


@dataclass(frozen=True)
class StoreRef:
    """One tier of a target: its config name, kind and (persistent kinds) directory."""

    name: str
    kind: str
    path: str | None = None
    capacity_blocks: int | None = None  # from the config, once the block size is known
    capacity_bytes: int | None = None
    instance: int | None = None  # NVMe: which instance of the configured path (0: the path)
    # Redis: the tier options (credentials too: kept out of repr)
    options: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def persistent(self) -> bool:
        return self.kind in PERSISTENT_KINDS

    @property
    def label(self) -> str:
        """The name in output: the tier's, with ``/instance{k}`` for an NVMe instance k > 0."""
        return f"{self.name}/instance{self.instance}" if self.instance else self.name


@dataclass(frozen=True)
class Target:
    """What CONFIG_OR_PATH named."""

    source: str
    config: CacheConfig | None
    tiers: tuple[StoreRef, ...]
    telemetry_dir: str | None = None

    def stores(self, names: Sequence[str] = ()) -> list[StoreRef]:
        """The persistent tiers, or those named (ValueError for a name not in the target)."""
        known = list(dict.fromkeys(t.name for t in self.tiers))
        for n in names:
            if n not in known:
                raise ValueError(
                    f"--tier: no tier named {n!r} in {self.source} "
                    f"(tiers: {', '.join(known) or 'none'})"
                )
        return [t for t in self.tiers if t.persistent and (not names or t.name in names)]


def resolve(target: str | os.PathLike[str]) -> Target:
    """Classify CONFIG_OR_PATH; ValueError naming the problem when it is none of them."""
    p = Path(target)
    if p.is_file():
        cfg = CacheConfig.from_toml(p)
        refs = []
        for tc in cfg.tiers:
            path = tc.options.get("path")
            ref = StoreRef(
                tc.name,
                tc.kind,
                os.path.abspath(path) if path else None,
                tc.capacity_blocks,
                tc.capacity_bytes,
                options=tc.options if tc.kind == "redis" else {},
            )
            refs += _with_instances(ref)
        tel = cfg.telemetry.dir if cfg.telemetry else None
        return Target(str(p), cfg, tuple(refs), os.path.abspath(tel) if tel else None)
    if p.is_dir():
        nvme = _with_instances(StoreRef("nvme", "nvme", str(p.absolute())))
        if (p / "meta.json").is_file() or len(nvme) > 1:
            if not (p / "meta.json").is_file():
                nvme = nvme[1:]  # only instances k >= 1 were ever opened
            return Target(str(p), None, tuple(nvme))
        if (p / "data.mdb").is_file():
            return Target(str(p), None, (StoreRef("lmdb", "lmdb", str(p.absolute())),))
        if (p / STATS_FILE).is_file() or (p / EVENTS_FILE).is_file():
            return Target(str(p), None, (), str(p.absolute()))
        ranks = [os.path.basename(r) for r in rank_dirs(str(p))]
        hint = f"; per-rank telemetry in: {', '.join(ranks)}" if ranks else ""
        raise ValueError(
            f"{p} is not a tiercache store or telemetry directory "
            f"(no meta.json, data.mdb or stats.json){hint}"
        )
    if not p.exists():
        raise ValueError(f"{p}: no such file or directory")
    raise ValueError(f"{p} is neither a TOML config nor a directory")


def rank_dirs(directory: str) -> list[str]:
    """The per-rank telemetry directories under `directory` (`tp0of2`, `tp1of2-dp0of2`, ...,
    `per_rank_telemetry`), in rank order, when it has no stats file of its own; else []."""
    if os.path.isfile(os.path.join(directory, STATS_FILE)):
        return []
    try:
        names = [
            n
            for n in os.listdir(directory)
            if os.path.isfile(os.path.join(directory, n, STATS_FILE))
        ]
    except OSError:
        return []

    # dp before tp (a DP rank holds TP ranks), numbers as numbers: tp2of16 before tp10of16
    def order(name: str) -> tuple[int, ...]:
        nums = {k: int(v) for k, v in re.findall(r"(tp|dp)(\d+)of", name)}
        return (nums.get("dp", 0), nums.get("tp", 0))

    return [os.path.join(directory, n) for n in sorted(names, key=lambda n: (order(n), n))]


def _with_instances(ref: StoreRef) -> list[StoreRef]:
    """`ref` and, for an NVMe path, a ref per instance directory found under it."""
    if ref.kind != "nvme":
        return [ref]
    ref = dataclasses.replace(ref, instance=0)
    if ref.path is None:
        return [ref]
    from tiercache.tiers.nvme import instance_dirs

    extra = [
        dataclasses.replace(ref, path=d, instance=k)
        for k, d in instance_dirs(ref.path)
        if os.path.isfile(os.path.join(d, "meta.json"))
    ]
    return [ref, *extra]


def capacity_of(ref: StoreRef, block_bytes: int) -> int | None:
    if ref.capacity_blocks is not None:
        return ref.capacity_blocks
    if ref.capacity_bytes is not None:
        return ref.capacity_bytes // block_bytes
    return None


# -- namespaces ----------------------------------------------------------------------------------


def parse_namespace(value: str) -> int:
    """A namespace as the config writes it, or `id:<16 hex digits>` as inspect prints an id
    it cannot name."""
    if value.startswith("id:"):
        h = value[3:]
        if len(h) != 16 or any(c not in "0123456789abcdefABCDEF" for c in h):
            raise ValueError(f"--namespace: {value!r}: expected 'id:' and 16 hex digits")
        return int(h, 16)
    if not value:
        raise ValueError("--namespace: must not be empty")
    return namespace_id(value)


def known_names(target: Target, extra: Iterable[str] = ()) -> dict[int, str]:
    """Namespace ids this run can name: the config's and those given on the command line."""
    names = [*(([target.config.namespace]) if target.config else []), *extra]
    return {namespace_id(n): n for n in names if not n.startswith("id:")}


# -- the stores --------------------------------------------------------------------------------


def offline(ref: StoreRef) -> OfflineStore:
    """The persistent store `ref` names, as its tier kind reads and changes it offline."""
    assert ref.path is not None
    return tier_class(ref.kind).offline_store(ref.path, ref.name)


@dataclass
class VerifyReport:
    """What `verify_store` found in one store."""

    ref: StoreRef
    checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def inspect_store(
    ref: StoreRef, names: dict[int, str], *, namespace: str | None = None, redis_scan: bool = False
) -> dict[str, Any]:
    """One tier's description; for persistent tiers what is on disk, read-only; for Redis
    what the server tells cheaply (`redis_scan`: keys per namespace, O(keys)), `namespace`
    naming the config's."""
    out: dict[str, Any] = {"name": ref.name, "kind": ref.kind, "path": ref.path}
    if ref.kind == "redis":
        import redis

        from tiercache.cli.redis_info import inspect_redis

        out.update(capacity_blocks=ref.capacity_blocks, capacity_bytes=ref.capacity_bytes)
        try:
            out.update(inspect_redis(ref.options, namespace, scan=redis_scan))
        except (redis.RedisError, OSError) as exc:
            out["note"] = f"the server did not answer: {exc}"
        return out
    if ref.instance is not None:
        out["instance"] = ref.instance
    if not ref.persistent:
        out["capacity_bytes"] = ref.capacity_bytes
        out["capacity_blocks"] = ref.capacity_blocks
        out["note"] = "volatile: contents live in the engine (see `tiercache stats`)"
        return out
    store = offline(ref)
    if not store.exists():
        out["note"] = "no store yet"
        return out
    out.update(store.describe(names))
    if out["capacity_blocks"] is None:  # the store records none: the config's
        out["capacity_blocks"] = capacity_of(ref, out["block_bytes"])
    return out


def count_blocks(ref: StoreRef) -> int:
    """Entries a verify of `ref` will read (for a progress bar's total)."""
    return offline(ref).count()


def verify_store(ref: StoreRef, advance: Callable[[int], None] = lambda n: None) -> VerifyReport:
    """Read every block of `ref` and check it (header, key, length, checksum, decompression)
    and the index (damaged records, entries without data); read-only."""
    store = offline(ref)
    if not store.exists():
        return VerifyReport(ref, notes=["no store yet"])
    return VerifyReport(ref, *store.verify(advance))


def repair_store(ref: StoreRef, rep: VerifyReport) -> int:
    """Drop what `verify_store` found bad; the number of entries dropped (NVMe needs the
    store closed)."""
    return offline(ref).repair(rep.problems) if rep.problems else 0


# -- evict and clear -----------------------------------------------------------------------------


def list_blocks(ref: StoreRef) -> list[BlockInfo]:
    """The good blocks of a store, oldest first."""
    store = offline(ref)
    return sorted(store.blocks(), key=lambda b: b.seq) if store.exists() else []


def drop_blocks(ref: StoreRef, victims: Iterable[BlockInfo]) -> int:
    """Remove these blocks (as `list_blocks` gave them) from the store; the number removed.
    Only the given namespace's block goes where tenants hold equal keys."""
    victims = list(victims)
    return offline(ref).drop(victims) if victims else 0


def check_owner_free(ref: StoreRef) -> None:
    """StoreError early when the store cannot change now (an NVMe store another process
    holds), before prompting."""
    store = offline(ref)
    if store.exists():
        store.check_free()
