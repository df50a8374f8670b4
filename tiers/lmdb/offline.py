"""Offline access to an LMDB store, for the CLI (inspect, verify, evict) and for processes
that do not hold the store as a tier (vLLM's scheduler).

- `open_store(path, write=False)` -> `StoreHandle`: an existing store's environment, opened
  read-only unless asked (borrowed when a tier of this process has it open).
- `LMDBProbe`: a read-only `StoreProbe` (`LMDBTier.open_probe`): headers only, each
  question (`probe`, `present`) in one read transaction.
- `iter_entries`, `delete_entries`: walk or delete entries in short transactions.
- `holder_pid(path)`: which process holds the environment open (this one's, then lock.mdb).
- `block_infos(h)`: the good blocks; `entry_problem(...)`: what is wrong with one entry.
- `LMDBOffline`: the store as the CLI's `OfflineStore` (`LMDBTier.offline_store`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import lmdb
import numpy as np
import zstandard

from tiercache.backoff import Backoff
from tiercache.errors import BlockCorruptError, ConfigError
from tiercache.tiers.format import (
    FORMAT_VERSION,
    decode_payload,
    header_check,
    header_of,
    header_problem,
    namespace_id,
)
from tiercache.tiers.lmdb import attach as lmdb_attach
from tiercache.tiers.lmdb.env import borrow, detach, is_open, open_lmdb, parse_meta
from tiercache.tiers.lmdb.layout import (
    BLOCKS_DB,
    COUNT_PREFIX,
    DB_NAMES,
    HEADS_DB,
    META_DB,
    META_KEY,
    MIN_TXN_OPS,
    NS_BYTES,
    ORDER_DB,
    Prober,
    StoreTxn,
    heads_prober,
    iter_prefix,
    split_store_key,
    store_key,
    u64,
)
from tiercache.tiers.offline import BlockInfo, Problem, namespace_label, summarize
from tiercache.tiers.store_dir import store_path

log = logging.getLogger("tiercache.tiers.lmdb")  # the package's one logger name
T = TypeVar("T")


@dataclass(frozen=True)
class StoreHandle:
    """An open environment of an existing store: its databases and validated metadata."""

    path: str
    env: lmdb.Environment
    heads: Any
    blocks: Any
    meta: dict[str, Any]
    write_lock: threading.Lock
    meta_db: Any = None
    order: Any = None
    removed: Any = None  # the removal log (None in a store of format 3 opened read-only)

    def counts(self) -> dict[int, int]:
        """Namespace id -> the block count the store keeps for it (what its capacity bounds)."""
        out = {}
        with self.env.begin(write=False) as txn:
            for k, v in iter_prefix(txn.cursor(db=self.meta_db), COUNT_PREFIX, values=True):
                out[int.from_bytes(k[len(COUNT_PREFIX) :], "big")] = u64(v)
        return out


@contextlib.contextmanager
def open_store(path: str | os.PathLike[str], *, write: bool = False) -> Iterator[StoreHandle]:
    """An existing store for offline tools, opened read-only unless `write` (other processes
    may hold it open meanwhile); borrowed when a tier of this process has it open, since LMDB
    forbids a second open in one process. ConfigError when `path` is not a store."""
    real = os.path.realpath(store_path(path))
    if not os.path.isfile(os.path.join(real, "data.mdb")):
        raise ConfigError("path", f"{real} is not an LMDB store (no data.mdb)")
    shared = borrow(real)
    if shared is not None:
        try:
            with shared.env.begin(write=False) as txn:
                meta = parse_meta(real, txn.get(META_KEY, b"", db=shared.meta))
            yield StoreHandle(
                real,
                shared.env,
                shared.heads,
                shared.blocks,
                meta,
                shared.write_lock,
                shared.meta,
                shared.order,
                shared.removed,
            )
        finally:
            detach(shared)
        return
    env = open_lmdb(real, write=write)  # as the tiers open it: a cold probe reads its pages only
    try:
        try:
            with env.begin(write=False) as txn:
                names = set(txn.cursor().iternext(values=False))
                if META_DB not in names:
                    raise ConfigError(
                        "path", f"{real}: no tiercache metadata in this LMDB environment"
                    )
                meta_db = env.open_db(META_DB, txn=txn, create=False)
                meta = parse_meta(real, txn.get(META_KEY, b"", db=meta_db))
            if not {HEADS_DB, BLOCKS_DB, ORDER_DB} <= names:
                raise ConfigError("path", f"{real}: the heads, blocks or order database is missing")
            # Outside that txn: a handle opened in a read txn dies with it.
            dbs = [env.open_db(n, create=False) if n in names else None for n in DB_NAMES]
        except lmdb.Error as exc:
            raise ConfigError("path", f"{real}: unreadable LMDB environment: {exc}") from None
        meta_db, heads, blocks, order, removed = dbs
        yield StoreHandle(real, env, heads, blocks, meta, threading.Lock(), meta_db, order, removed)
    finally:
        env.close()


class LMDBProbe:
    """A read-only `StoreProbe` of an LMDB store (`LMDBTier.open_probe`), opened when first
    asked, and again after a failure at most every `RETRY_S`; it never writes."""

    RETRY_S = 1.0

    def __init__(self, path: str, block_bytes: int, *, namespace: str = "") -> None:
        self._path = path
        self._block_bytes = block_bytes
        self._ns = namespace_id(namespace)
        self._nsb = self._ns.to_bytes(NS_BYTES, "big")
        self._ours = header_check(self._ns, block_bytes)
        self._stack: contextlib.ExitStack | None = None
        self._handle: StoreHandle | None = None
        self._retry = Backoff(self.RETRY_S, self.RETRY_S)  # ready at first
        self._lock = threading.Lock()

    def _open(self) -> StoreHandle | None:
        if self._handle is None and self._retry.ready():
            stack = contextlib.ExitStack()
            try:
                self._handle = stack.enter_context(open_store(self._path))
                self._stack = stack
            except (ConfigError, OSError) as exc:
                stack.close()
                self._retry.fail()  # the next try at least RETRY_S from now
                log.debug("LMDB probe of %s: not open yet (%s)", self._path, exc)
        return self._handle

    def probe(self, keys: Sequence[bytes]) -> int:
        return self._ask(lambda txn, leading: leading(txn, keys)) or 0

    def present(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key, what `probe([key])` would answer, in one read transaction; None while
        the store cannot be opened or read."""
        return self._ask(lambda txn, leading: [leading(txn, [k]) == 1 for k in keys])

    def _ask(self, answer: Callable[[lmdb.Transaction, Prober], T]) -> T | None:
        """`answer(txn, leading)` in one read transaction (`leading`: `heads_prober` of this
        namespace), or None while the store cannot be opened or a transaction begun."""
        with self._lock:
            h = self._open()
            if h is None:
                return None
            try:
                txn = h.env.begin(write=False)
            except lmdb.MapResizedError:
                # A writer grew the map since we opened: adopt its size and go on.
                h.env.set_mapsize(0)
                txn = h.env.begin(write=False)
            except lmdb.Error as exc:
                log.debug("LMDB probe of %s: %s", self._path, exc)
                return None
            try:
                return answer(txn, heads_prober(h.heads, h.order, self._nsb, self._ours))
            finally:
                txn.abort()

    def close(self) -> None:
        with self._lock:
            stack, self._stack, self._handle = self._stack, None, None
            self._retry.hold(math.inf)  # never again
        if stack is not None:
            stack.close()


def iter_entries(
    h: StoreHandle, *, chunk: int = 256
) -> Iterator[tuple[bytes, bytes | None, memoryview | None]]:
    """(key, header, payload) for every key in either database, in key order; a side that is
    missing is None. The payload is a zero-copy view valid until the next item (its pages are
    read only when used). Read transactions of at most `chunk` keys: a long scan pins no old
    pages of a writing process for long."""
    start = b""
    while True:
        with h.env.begin(write=False, buffers=True) as txn:
            cur_h, cur_b = txn.cursor(db=h.heads), txn.cursor(db=h.blocks)
            more_h, more_b = cur_h.set_range(start), cur_b.set_range(start)
            n = 0
            while (more_h or more_b) and n < chunk:
                kh = bytes(cur_h.key()) if more_h else None
                kb = bytes(cur_b.key()) if more_b else None
                key = min(k for k in (kh, kb) if k is not None)
                head = bytes(cur_h.value()) if kh == key else None
                payload = cur_b.value() if kb == key else None
                yield key, head, payload
                if kh == key:
                    more_h = cur_h.next()
                if kb == key:
                    more_b = cur_b.next()
                n += 1
            if not (more_h or more_b):
                return
            start = min(bytes(c.key()) for c, m in ((cur_h, more_h), (cur_b, more_b)) if m)


def delete_entries(h: StoreHandle, keys: Iterable[bytes]) -> int:
    """Delete the header, payload and order entry of each key (and its namespace's count),
    in write transactions of at most `MIN_TXN_OPS` keys; the number of keys that had a header
    or a payload. A process holding the store open reads a deleted block as a miss."""
    todo = list(keys)
    gone = 0
    with h.write_lock:
        for a in range(0, len(todo), MIN_TXN_OPS):
            try:
                with h.env.begin(write=True) as txn:
                    store = StoreTxn(txn, h.meta_db, h.heads, h.blocks, h.order, h.removed)
                    for k in todo[a : a + MIN_TXN_OPS]:
                        had = any(txn.get(k, db=d) is not None for d in (h.heads, h.blocks))
                        store.delete(k, None)
                        gone += had
                    store.finish()
            except lmdb.Error as exc:
                raise OSError(errno.EIO, f"{h.path}: LMDB delete failed: {exc}") from None
    return gone


_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux: type, whence, start, len, pid


def holder_pid(path: str) -> int | None:
    """The pid of a process holding the LMDB environment open, else None.

    LMDB keeps a shared fcntl lock on byte 0 of lock.mdb while an environment is open; this
    asks (F_GETLK) who would block an exclusive one. This process's own pid, without asking,
    when a tier of it holds the environment: closing our probe descriptor would drop its locks."""
    if is_open(path):
        return os.getpid()
    try:
        fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        res = fcntl.fcntl(fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
        ltype, _, _, _, pid = _FLOCK.unpack(res)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if ltype == fcntl.F_UNLCK else pid


def block_infos(h: StoreHandle) -> tuple[list[BlockInfo], int]:
    """Each good block of an open store, header and payload length checked; and how many
    entries are malformed or orphaned."""
    bb = h.meta["block_bytes"]
    good, bad = [], 0
    for skey, head, payload in iter_entries(h):
        split = split_store_key(skey)
        if head is None or payload is None or split is None:
            bad += 1
            continue
        ns, key = split
        try:
            hd = header_of(head, key, ns, bb)
        except BlockCorruptError:
            hd = None
        if hd is None or hd.stored_len != len(payload):
            bad += 1
            continue
        good.append(BlockInfo(key, hd.seq, hd.namespace_id, hd.raw_len, hd.stored_len))
    return good, bad


def entry_problem(
    skey: bytes,
    head: bytes | None,
    payload: memoryview | None,
    block_bytes: int,
    scratch: Any,
    dz: Any,
) -> tuple[bytes, str | None]:
    """The block key of an `iter_entries` item and what is wrong with it (store key, orphan
    header or payload, header, checksum, decompression), its payload decoded into `scratch`
    with the zstd decompressor `dz`; None when it is good."""
    split = split_store_key(skey)
    ns, key = split if split is not None else (None, skey)
    if split is None:
        return key, f"a store key of {len(skey)} bytes"
    if head is None:
        return key, "payload without a header (orphan)"
    if payload is None:
        return key, "header without a payload"
    try:
        hd = header_of(head, key, None, block_bytes)
        decode_payload(hd, payload, scratch, decompressor=dz)
        what = header_problem(hd, key, ns, None)  # after the checksum
    except BlockCorruptError as exc:
        what = str(exc)
    return key, what


class LMDBOffline:
    """An LMDB store as an `OfflineStore`, opened by each call (`open_store`): read-only but
    for `repair` and `drop`, which delete beside any process holding the store open (it then
    reads the dropped blocks as misses)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def count(self) -> int:
        with open_store(self.path) as h, h.env.begin() as txn:
            return int(txn.stat(h.heads)["entries"])

    def blocks(self) -> list[BlockInfo]:
        with open_store(self.path) as h:
            return block_infos(h)[0]

    def describe(self, names: Mapping[int, str]) -> dict[str, Any]:
        """With the store's per-namespace usage, attach entries and reader table; namespaces
        also by the names the store recorded."""
        holder = holder_pid(self.path)  # before our own open (see holder_pid)
        with open_store(self.path) as h:
            blocks, bad = block_infos(h)
            with h.env.begin(write=False) as txn:
                rec = lmdb_attach.read_records(txn, h.meta_db)
            names = {**rec.names, **names}
            info, st = h.env.info(), h.env.stat()
            return {
                "format": f"tiercache-lmdb v{h.meta['version']}, block format v{FORMAT_VERSION}",
                "block_bytes": h.meta["block_bytes"],
                "capacity_blocks": None,  # it records one per namespace (namespace_usage)
                "used_blocks": len(blocks),
                "file_bytes": (info["last_pgno"] + 1) * st["psize"],
                "map_size": info["map_size"],
                **summarize(blocks, names),
                "unreadable_entries": bad,
                "last_modified": os.stat(os.path.join(h.path, "data.mdb")).st_mtime,
                "in_use": holder is not None,
                "holder_pid": holder,
                **_sharing(h, rec, blocks, names, own=holder == os.getpid()),
            }

    def verify(self, advance: Callable[[int], None]) -> tuple[int, list[Problem], list[str]]:
        """Every entry of either database (`entry_problem`)."""
        dz = zstandard.ZstdDecompressor()
        checked, problems = 0, []
        with open_store(self.path) as h:
            bb = h.meta["block_bytes"]
            scratch = np.empty(bb, dtype=np.uint8)
            for skey, head, payload in iter_entries(h):
                key, what = entry_problem(skey, head, payload, bb, scratch, dz)
                if head is not None:
                    checked += 1
                    advance(1)
                if what:
                    problems.append(Problem(f"key {key.hex()}", what, key, entry=skey))
        return checked, problems, []

    def repair(self, problems: Iterable[Problem]) -> int:
        with open_store(self.path, write=True) as h:
            return delete_entries(h, {p.entry for p in problems if p.entry is not None})

    def drop(self, blocks: Iterable[BlockInfo]) -> int:
        """Only the given namespace's block goes where tenants hold equal keys."""
        with open_store(self.path, write=True) as h:
            return delete_entries(h, {store_key(b.namespace, b.key) for b in blocks})

    def check_free(self) -> None:
        """Never in the way: changes go beside the processes holding the store open."""


def _sharing(
    h: StoreHandle,
    rec: lmdb_attach.StoreRecords,
    blocks: list[BlockInfo],
    names: Mapping[int, str],
    own: bool,
) -> dict[str, Any]:
    """Per-namespace usage (blocks found, the store's count, the recorded capacity), the
    attach entries and LMDB's reader table of an open store. `own`: this process holds the
    store open through a tier (its reader slots are then shown too)."""
    counts = h.counts()
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
