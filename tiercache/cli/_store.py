"""Offline access to the stores a CONFIG_OR_PATH names, shared by the CLI commands.

Primitives:
- `resolve(target)` -> `Target`: a TOML config (its tiers and telemetry directory), one store
  directory (NVMe: has meta.json; LMDB: has data.mdb) or a telemetry directory (stats.json).
  An NVMe store's instances (``path/instance{k}``, tiers/nvme/layout.py) are stores of their own.
- `inspect_store(ref, names)`: what a store holds, read-only (works beside a running engine).
- `verify_store(ref, advance)`: every block read and checked; `repair_store` drops bad ones.
- `list_blocks(ref)` / `drop_blocks(ref, keys)`: what `evict` and `clear` choose from and drop.

Read-only paths never take a lock a running engine needs and write nothing to the store;
dropping blocks from an NVMe store needs it closed (its index lives in the owner's memory),
an LMDB store may stay open elsewhere (its owner then reads dropped blocks as misses).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiercache.config import CacheConfig
from tiercache.errors import ConfigError, TierCacheError
from tiercache.telemetry import EVENTS_FILE, STATS_FILE
from tiercache.tiers.format import FORMAT_VERSION, namespace_id

PERSISTENT_KINDS = ("nvme", "lmdb")
_READ_BATCH_BYTES = 64 * 2**20  # rows per tier.read during a repair


class StoreError(TierCacheError):
    """A store cannot be used for what was asked (e.g. it is open in another process)."""


@dataclass(frozen=True)
class StoreRef:
    """One tier of a target: its config name, kind and (persistent kinds) directory."""

    name: str
    kind: str
    path: str | None = None
    capacity_blocks: int | None = None  # from the config, once the block size is known
    capacity_bytes: int | None = None
    instance: int = 0  # NVMe: which instance of the configured path (0: the path itself)
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
    if ref.kind != "nvme" or ref.path is None:
        return [ref]
    from tiercache.tiers.nvme import instance_dirs

    extra = [
        dataclasses.replace(ref, path=d, instance=k)
        for k, d in instance_dirs(ref.path)
        if os.path.isfile(os.path.join(d, "meta.json"))
    ]
    return [ref, *extra]


def has_store(ref: StoreRef) -> bool:
    """Whether the store exists (an NVMe path that only holds instances of it has none)."""
    if ref.path is None or not os.path.exists(ref.path):
        return False
    return ref.kind != "nvme" or os.path.exists(os.path.join(ref.path, "meta.json"))


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


def namespace_label(ns: int, names: dict[int, str]) -> str:
    return names.get(ns, f"id:{ns:016x}")


def known_names(target: Target, extra: Iterable[str] = ()) -> dict[int, str]:
    """Namespace ids this run can name: the config's and those given on the command line."""
    out = {}
    for n in [*(([target.config.namespace]) if target.config else []), *extra]:
        if not n.startswith("id:"):
            out[namespace_id(n)] = n
    return out


# -- reading blocks ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One stored block: its key, write sequence, namespace tag and sizes; `slot` for NVMe."""

    key: bytes
    seq: int
    namespace: int
    raw_len: int
    stored_len: int
    slot: int | None = None


@dataclass
class Problem:
    """Something wrong in a store: where (a slot, a key, or the index) and what."""

    where: str
    what: str
    key: bytes | None = None
    slot: int | None = None
    entry: bytes | None = None  # LMDB: the store key (namespace id + block key) to delete


@dataclass
class VerifyReport:
    """What `verify_store` found in one store."""

    ref: StoreRef
    checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def bad_keys(self) -> list[bytes]:
        return [p.key for p in self.problems if p.key is not None]

    @property
    def bad_entries(self) -> list[bytes]:
        """LMDB store keys of the bad entries."""
        return [p.entry for p in self.problems if p.entry is not None]


def _nvme_reader(ref: StoreRef) -> Any:
    from tiercache.tiers.nvme import NVMeStoreReader

    assert ref.path is not None
    return NVMeStoreReader(ref.path)


def _nvme_headers(reader: Any) -> tuple[list[BlockInfo], int]:
    """Good blocks the journal names (headers read, payloads not), and how many entries
    fail their header check."""
    good, bad = reader.headers()
    return [
        BlockInfo(h.key, h.seq, h.namespace_id, h.raw_len, h.stored_len, e.slot) for e, h in good
    ], bad


def _lmdb_blocks(h: Any) -> tuple[list[BlockInfo], int]:
    """Good blocks of an open LMDB store (headers and payload lengths), and the number of
    malformed or orphaned entries."""
    from tiercache.tiers.lmdb.offline import block_headers

    good, bad = block_headers(h)
    return [BlockInfo(key, h.seq, h.namespace_id, h.raw_len, h.stored_len) for key, h in good], bad


def _summary(blocks: list[BlockInfo], names: dict[int, str]) -> dict[str, Any]:
    raw = sum(b.raw_len for b in blocks)
    stored = sum(b.stored_len for b in blocks)
    ns = Counter(namespace_label(b.namespace, names) for b in blocks)
    return {
        "blocks": len(blocks),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "compression_ratio": raw / stored if stored else 1.0,
        "namespaces": dict(ns.most_common()),
        "oldest_seq": min((b.seq for b in blocks), default=None),
        "newest_seq": max((b.seq for b in blocks), default=None),
    }


def inspect_store(
    ref: StoreRef, names: dict[int, str], *, namespace: str | None = None, redis_scan: bool = False
) -> dict[str, Any]:
    """One tier's description; for persistent tiers what is on disk, read-only; for Redis
    what the server tells cheaply (`redis_scan`: keys per namespace, O(keys)), `namespace`
    naming the config's."""
    out: dict[str, Any] = {"name": ref.name, "kind": ref.kind, "path": ref.path}
    if ref.kind == "redis":
        import redis

        from tiercache.cli._redis import inspect_redis

        out.update(capacity_blocks=ref.capacity_blocks, capacity_bytes=ref.capacity_bytes)
        try:
            out.update(inspect_redis(ref.options, namespace, scan=redis_scan))
        except (redis.RedisError, OSError) as exc:
            out["note"] = f"the server did not answer: {exc}"
        return out
    if ref.kind == "nvme":
        out["instance"] = ref.instance
    if not ref.persistent:
        out["capacity_bytes"] = ref.capacity_bytes
        out["capacity_blocks"] = ref.capacity_blocks
        out["note"] = "volatile: contents live in the engine (see `tiercache stats`)"
        return out
    assert ref.path is not None
    if not has_store(ref):
        out["note"] = "no store yet"
        return out
    if ref.kind == "nvme":
        with _nvme_reader(ref) as r:
            blocks, bad = _nvme_headers(r)
            cap = r.capacity_blocks
            out.update(
                format=f"tiercache-nvme v{r.meta['version']}, block format v{FORMAT_VERSION}",
                block_bytes=r.block_bytes,
                capacity_blocks=cap,
                used_blocks=len(blocks),
                file_bytes=r.slab_size,
                **_summary(blocks, names),
                unreadable_entries=bad,
                index_damaged_records=r.journal.damaged,
                last_modified=r.last_modified(),
                in_use=(pid := r.holder()) is not None,
                holder_pid=pid if pid and pid > 0 else None,
            )
    else:
        from tiercache.tiers.lmdb.offline import holder_pid, open_store

        holder = holder_pid(ref.path)
        with open_store(ref.path) as h:
            blocks, bad = _lmdb_blocks(h)
            sharing = _lmdb_sharing(h, blocks, names, own=holder == os.getpid())
            names = {**sharing.pop("names"), **names}
            info, st = h.env.info(), h.env.stat()
            bb = h.meta["block_bytes"]
            cap = capacity_of(ref, bb)
            out.update(
                format=f"tiercache-lmdb v{h.meta['version']}, block format v{FORMAT_VERSION}",
                block_bytes=bb,
                capacity_blocks=cap,
                used_blocks=len(blocks),
                file_bytes=(info["last_pgno"] + 1) * st["psize"],
                map_size=info["map_size"],
                **_summary(blocks, names),
                unreadable_entries=bad,
                last_modified=os.stat(os.path.join(h.path, "data.mdb")).st_mtime,
                in_use=holder is not None,
                holder_pid=holder,
                **sharing,
            )
    return out


def _lmdb_sharing(
    h: Any, blocks: list[BlockInfo], names: dict[int, str], own: bool
) -> dict[str, Any]:
    """Per-namespace usage (blocks found, the store's count, the recorded capacity), the
    attach entries and LMDB's reader table of an open store; `names` for labels, completed
    by the names the store recorded (returned under "names"). `own`: this process holds the
    store open through a tier (its reader slots are then shown too)."""
    from tiercache.tiers.lmdb import attach as lmdb_attach

    with h.env.begin(write=False) as txn:
        rec = lmdb_attach.read_records(txn, h.meta_db)
    counts = h.counts()
    names = {**rec.names, **names}
    found = Counter(b.namespace for b in blocks)
    attached = [(a, a.state) for a in rec.attached]
    live = Counter(a.namespace_id for a, st in attached if st != "stale")
    usage = []
    for ns in sorted(set(found) | set(counts) | set(rec.capacities) | set(live)):
        cap = rec.capacities.get(ns)
        usage.append(
            {
                "namespace": namespace_label(ns, names),
                "id": f"{ns:016x}",
                "blocks": found.get(ns, 0),
                "counted": counts.get(ns),
                "capacity_blocks": cap,
                "used": found.get(ns, 0) / cap if cap else None,
                "attached": live.get(ns, 0),
            }
        )
    me = os.getpid()
    return {
        "names": rec.names,
        "namespace_usage": usage,
        "attached": [
            {
                "pid": a.pid,
                "host": a.host,
                "namespace": namespace_label(a.namespace_id, names),
                "opened_at": a.opened_at,
                "capacity_blocks": a.capacity_blocks,
                "state": st,
            }
            for a, st in attached
        ],
        "readers": [
            {"pid": r.pid, "thread": r.thread, "txn": r.txn}
            for r in lmdb_attach.readers(h.env)
            if own or r.pid != me  # not the slot of this inspection's own read
        ],
    }


# -- verify and repair ---------------------------------------------------------------------------


def count_blocks(ref: StoreRef) -> int:
    """Entries a verify of `ref` will read (for a progress bar's total)."""
    if ref.kind == "nvme":
        with _nvme_reader(ref) as r:
            return len(r.entries)
    from tiercache.tiers.lmdb import open_store

    with open_store(ref.path or "") as h, h.env.begin() as txn:
        return int(txn.stat(h.heads)["entries"])


def verify_store(ref: StoreRef, advance: Callable[[int], None] = lambda n: None) -> VerifyReport:
    """Read every block of `ref` and check it (header, key, length, checksum, decompression)
    and the index (damaged records, entries without data); read-only."""
    rep = VerifyReport(ref)
    if not has_store(ref):
        rep.notes.append("no store yet")
        return rep
    if ref.kind == "nvme":
        _verify_nvme(ref, rep, advance)
    else:
        _verify_lmdb(ref, rep, advance)
    return rep


def _verify_nvme(ref: StoreRef, rep: VerifyReport, advance: Callable[[int], None]) -> None:
    import numpy as np

    with _nvme_reader(ref) as r:
        scratch = np.empty(r.block_bytes, dtype=np.uint8)
        want = r.capacity_blocks * r.slot_bytes  # at least: kept blocks add slots
        if r.slab_size < want:
            rep.problems.append(
                Problem("slab", f"holds {r.slab_size} bytes, {want} expected for its capacity")
            )
        j = r.journal
        if j.damaged:
            rep.problems.append(Problem("index", f"{j.damaged} damaged journal records"))
        if j.out_of_range:
            rep.problems.append(
                Problem("index", f"{j.out_of_range} records name slots beyond the slab")
            )
        bad = []
        for e in r.entries:
            what = r.entry_problem(e, scratch)
            if what:
                bad.append((e, what))
            rep.checked += 1
            advance(1)
        if bad and r.in_use():
            # The owner may have freed and rewritten a slot after we read the journal: keep
            # only entries that are still live and still fail.
            r.reload()
            live = set(r.entries)
            still = [(e, r.entry_problem(e, scratch)) for e, _ in bad if e in live]
            bad = [(e, w) for e, w in still if w]
            if bad:
                rep.notes.append("the store is open in another process; rechecked once")
        for e, what in bad:
            rep.problems.append(Problem(f"slot {e.slot}", what, e.key, e.slot))


def _verify_lmdb(ref: StoreRef, rep: VerifyReport, advance: Callable[[int], None]) -> None:
    import numpy as np
    import zstandard

    from tiercache.tiers.lmdb.offline import entry_problem, iter_entries, open_store

    dz = zstandard.ZstdDecompressor()
    with open_store(ref.path or "") as h:
        bb = h.meta["block_bytes"]
        scratch = np.empty(bb, dtype=np.uint8)
        for skey, head, payload in iter_entries(h):
            key, what = entry_problem(skey, head, payload, bb, scratch, dz)
            if head is not None:
                rep.checked += 1
                advance(1)
            if what:
                rep.problems.append(Problem(f"key {key.hex()}", what, key, entry=skey))


def open_nvme_tier(ref: StoreRef) -> Any:
    """The NVMe store as a tier of this process (its exclusive lock), at its own size;
    StoreError when another process holds it."""
    from tiercache.tiers.nvme import NVMeTier, read_meta

    assert ref.path is not None
    meta = read_meta(ref.path)
    slots = max(
        meta["capacity_blocks"],
        os.stat(os.path.join(ref.path, "slab")).st_size // meta["slot_bytes"],
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # O_DIRECT is not asked for
            return NVMeTier(
                name=ref.name,
                block_bytes=meta["block_bytes"],
                capacity_blocks=slots,  # every slot, kept ones included
                path=ref.path,
                fsync="batch",
                namespace=None,  # every namespace's blocks; never writes
                direct=False,
            )
    except ConfigError as exc:
        if "in use" in exc.problem:
            raise StoreError(
                f"{ref.path} is open in another process; stop it before changing the store"
            ) from None
        raise


def repair_store(ref: StoreRef, rep: VerifyReport) -> int:
    """Drop what `verify_store` found bad; the number of entries dropped. NVMe: reopening
    the store drops index entries whose header disagrees and rewrites a damaged journal, then
    blocks that fail a verified read are freed. LMDB: bad keys are deleted."""
    if not rep.problems:
        return 0
    if ref.kind == "lmdb":
        from tiercache.tiers.lmdb import delete_entries, open_store

        with open_store(ref.path or "", write=True) as h:
            return delete_entries(h, set(rep.bad_entries))
    tier = open_nvme_tier(ref)
    try:
        dropped = tier.open_report.get("blocks_dropped", 0)
        suspects = {(p.key, p.slot) for p in rep.problems if p.key is not None}
        held = [(k, s) for k, s in tier.recover() if (k, s) in suspects]
        step = max(1, _READ_BATCH_BYTES // tier.block_bytes)
        for a in range(0, len(held), step):
            part = held[a : a + step]
            dst = torch.empty((len(part), tier.block_bytes), dtype=torch.uint8)
            try:
                failed = tier.read([s for _, s in part], dst, [k for k, _ in part])
            except OSError:  # nothing of this batch could be read
                failed = list(range(len(part)))
            tier.free([part[i][1] for i in failed])
            dropped += len(failed)
        return dropped
    finally:
        tier.close()


# -- evict and clear -----------------------------------------------------------------------------


def list_blocks(ref: StoreRef) -> list[BlockInfo]:
    """The good blocks of a store, oldest first."""
    if not has_store(ref):
        return []
    if ref.kind == "nvme":
        with _nvme_reader(ref) as r:
            blocks, _ = _nvme_headers(r)
    else:
        from tiercache.tiers.lmdb import open_store

        with open_store(ref.path) as h:
            blocks, _ = _lmdb_blocks(h)
    return sorted(blocks, key=lambda b: b.seq)


def drop_blocks(ref: StoreRef, victims: Iterable[BlockInfo]) -> int:
    """Remove these blocks (as `list_blocks` gave them) from the store; the number removed.
    Only the given namespace's block goes where tenants hold equal keys."""
    victims = list(victims)
    if not victims:
        return 0
    if ref.kind == "lmdb":
        from tiercache.tiers.lmdb import delete_entries, open_store, store_key

        with open_store(ref.path or "", write=True) as h:
            return delete_entries(h, {store_key(b.namespace, b.key) for b in victims})
    want = {(b.key, b.slot) for b in victims}
    tier = open_nvme_tier(ref)
    try:
        slots = [s for k, s in tier.recover() if (k, s) in want]
        tier.free(slots)
        return len(slots)
    finally:
        tier.close()


def check_owner_free(ref: StoreRef) -> None:
    """StoreError early when an NVMe store is held by another process (before prompting)."""
    if ref.kind == "nvme" and has_store(ref):
        with _nvme_reader(ref) as r:
            if r.in_use():
                raise StoreError(
                    f"{ref.path} is open in another process; stop it before changing the store"
                )


__all__ = [
    "BlockInfo",
    "Problem",
    "StoreError",
    "StoreRef",
    "Target",
    "VerifyReport",
    "check_owner_free",
    "count_blocks",
    "drop_blocks",
    "inspect_store",
    "known_names",
    "list_blocks",
    "namespace_label",
    "parse_namespace",
    "repair_store",
    "resolve",
    "verify_store",
]
