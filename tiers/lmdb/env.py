"""The LMDB environment of a store as this process holds it.

- `map_size_for`: the map size (reserved on disk at open) for a capacity and block size.
- `pool`/`pool_map`: the codec and sync thread pools, and `fn` over a range split on them.
- `SharedEnv`: one open environment per real path per process, reference counted by
  `attach`/`detach`, borrowed by offline tools (`borrow`), asked after by `is_open`.
- `open_lmdb`, `parse_meta`: how every process opens an environment, its metadata."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import lmdb

from tiercache.errors import ConfigError
from tiercache.tiers import store_dir
from tiercache.tiers.base import KEY_BYTES
from tiercache.tiers.keyed import PendingDeletes
from tiercache.tiers.lmdb import warm as lmdb_warm
from tiercache.tiers.lmdb.layout import (
    DB_NAMES,
    HEADS_DB,
    MAX_READERS,
    META_DB,
    META_KEY,
    NS_BYTES,
    ORDER_DB,
    STORE_FORMAT,
    STORE_VERSION,
    UPGRADES_FROM,
    txn_ops_for,
)

log = logging.getLogger("tiercache.tiers.lmdb")  # the package's one logger name

_META_FORMAT = store_dir.MetaFormat("LMDB", STORE_FORMAT, STORE_VERSION, older=UPGRADES_FROM)


def map_size_for(
    capacity_blocks: int,
    block_bytes: int,
    page_size: int | None = None,
    *,
    removals_kept: int = 0,
) -> int:
    """LMDB map size (bytes) for `capacity_blocks` blocks of `block_bytes`.

    A payload of V bytes stored out of line takes ceil((V + 16) / page) overflow pages (a
    16-byte page header: a 4 KiB block takes two pages, a 64 KiB one 17); a small one stored
    inline takes up to twice its node in a half-full leaf. On top, per block, `ENTRY_BYTES`
    cover its "heads", "blocks" and "order" entries (~100 + 40 + 40 bytes of nodes) in leaves
    filled 50-70% by random keys, branch pages and its share of the freelist. LMDB reuses a
    freed page only two transactions later, so with at most K = `txn_ops_for` puts + deletes
    per transaction the file peaks near C + 2K blocks; the map allows C + 3K + 16 blocks (one
    K for a snapshot a concurrent reader pins) + 8 MiB, all reserved on disk at open
    (`_reserve`: with writemap, a write into a hole of a sparse file on a full disk is a
    SIGBUS, not an error). K is at most `MAX_TXN_OPS`. The removal log's entries (24 bytes in
    a record) fit in `ENTRY_BYTES` up to one per block; `removals_kept` beyond the capacity
    adds `REMOVAL_BYTES` each.
    """
    page = page_size or max(4096, os.sysconf("SC_PAGE_SIZE"))
    node = 8 + NS_BYTES + KEY_BYTES + block_bytes  # a leaf node holding the payload inline
    inline = node <= (page - 16) // 2  # LMDB's largest inline node (me_nodemax)
    payload = 2 * node if inline else math.ceil((block_bytes + 16) / page) * page
    per_block = payload + ENTRY_BYTES
    blocks = (capacity_blocks + 3 * txn_ops_for(capacity_blocks) + 16) * per_block
    return blocks + max(0, removals_kept - capacity_blocks) * REMOVAL_BYTES + (8 << 20)


ENTRY_BYTES = 512
REMOVAL_BYTES = 64  # a removal log entry in records in half-full pages, with the freelist


_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def pool(kind: str = "codec") -> ThreadPoolExecutor:
    """ "codec": threads for zstd and payload copies (both release the GIL; xxhash does not,
    so one thread hashes while another copies); "sync": one thread for the background
    env.sync of sync = "batch" (py-lmdb releases the GIL during it)."""
    with _POOLS_LOCK:
        ex = _POOLS.get(kind)
        if ex is None:
            workers = min(4, os.cpu_count() or 1) if kind == "codec" else 1
            ex = _POOLS[kind] = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix=f"tiercache-lmdb-{kind}"
            )
        return ex


def pool_map(fn: Callable[[int], Any], n: int, parallel: bool) -> list[Any]:
    """`fn` over range(n), on the codec pool when asked and there is more than one.
    Waits for every call before returning or raising: reads hand the pool zero-copy
    views that die with their transaction."""
    if n < 2 or not parallel:
        return [fn(i) for i in range(n)]
    # One contiguous chunk per thread, the caller's thread taking the first: a future per
    # block costs more than the copy and checksum of a 64 KiB block.
    codec = pool()
    parts = min(n, codec._max_workers + 1)
    bounds = [(n * w // parts, n * (w + 1) // parts) for w in range(parts)]

    def run(a: int, b: int) -> list[Any]:
        return [fn(i) for i in range(a, b)]

    futures = [codec.submit(run, a, b) for a, b in bounds[1:]]
    try:
        out = run(*bounds[0])
    finally:
        wait(futures)
    for f in futures:
        out += f.result()
    return out


# -- the directory and the shared environment ------------------------------------------------


class SharedEnv:
    """One open environment per real path in this process, shared by the tiers over it."""

    def __init__(
        self,
        path: str,
        env: lmdb.Environment,
        dbs: tuple[Any, Any, Any, Any, Any],
        block_bytes: int,
        map_size: int,
        durable: bool,
    ) -> None:
        self.path, self.env = path, env
        self.meta, self.heads, self.blocks, self.order, self.removed = dbs
        self.block_bytes = block_bytes
        self.map_size = map_size
        self.durable = durable  # opened with sync + metasync: every commit is durable
        self.refs = 0
        self.write_lock = threading.Lock()  # one write txn at a time from this process
        self.state_lock = threading.Lock()  # pending, seq, sync counters
        # store key -> the order seq of the entry to delete (None: whatever is there): blocks
        # freed, replaced, found corrupt or malformed, deleted in the next write txn (see
        # LMDBTier.read); one set for every tier of this process on the environment.
        self.pending = PendingDeletes()
        self.seq = 0
        self.last_sync = time.monotonic()
        self.bg_sync: Future[None] | None = None
        self.warm: threading.Thread | None = None  # the index warm pass (warm.py), once
        self.warm_report: dict[str, float] = {}

    def start_warm(self) -> None:
        """Warm the "heads" and "order" pages (never payloads) on a daemon thread, once per
        environment in this process, for the first lookups after a lazy open."""
        with self.state_lock:
            if self.warm is not None:
                return
            self.warm = threading.Thread(target=self._warm, name="tiercache-lmdb-warm", daemon=True)
        self.warm.start()

    def _warm(self) -> None:
        try:
            self.warm_report = lmdb_warm.warm_index(self.path, (HEADS_DB, ORDER_DB))
        except OSError as exc:  # a hint only: lookups read what they need anyway
            log.debug("%s: index warm pass stopped: %s", self.path, exc)

    def pend(self, deletes: dict[bytes, int | None]) -> None:
        """Store keys to delete in the next write txn, each with the order seq its delete
        wants (None: whatever entry is there)."""
        with self.state_lock:
            self.pending.entries.update(deletes)

    def next_seq(self, n: int) -> int:
        with self.state_lock:
            first = self.seq
            self.seq += n
            return first

    def background_sync(self) -> None:
        try:
            self.env.sync(True)
        except lmdb.Error as exc:  # the next flush() syncs in the foreground and raises
            log.warning("%s: background sync failed: %s", self.path, exc)

    def wait_sync(self) -> None:
        fut = self.bg_sync
        if fut is not None:
            fut.result()


_ENVS: dict[str, SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def attach(path: str, block_bytes: int, map_size: int, sync: str) -> SharedEnv:
    """The environment at real path `path`, opened (or, when a tier of this process has it
    open, shared) for a tier; `detach` when done. ConfigError when it cannot be."""
    with _ENVS_LOCK:
        shared = _ENVS.get(path)
        if shared is None:
            shared = _ENVS[path] = _open_env(path, block_bytes, map_size, sync)
        else:
            _META_FORMAT.check_block_bytes(shared.block_bytes, block_bytes, path)
            if map_size > shared.map_size:
                # Growing the map of an environment in use needs every transaction of this
                # process closed: refuse rather than remap under another tier's readers.
                raise ConfigError(
                    "path",
                    f"{path} is already open in this process with a smaller map "
                    f"({shared.map_size} bytes); open it with the same or a smaller capacity",
                )
        shared.refs += 1
        return shared


def detach(shared: SharedEnv) -> None:
    """Drop one use of `shared`; the last one syncs and closes the environment."""
    with _ENVS_LOCK:
        shared.refs -= 1
        if shared.refs > 0:
            return
        del _ENVS[shared.path]
    try:
        shared.wait_sync()
        shared.env.sync(True)
    except lmdb.Error as exc:
        log.warning("%s: sync at close failed: %s", shared.path, exc)
    finally:
        shared.env.close()


def borrow(path: str) -> SharedEnv | None:
    """The environment at real path `path` when a tier of this process has it open, with
    one more use (`detach` it when done); None otherwise."""
    with _ENVS_LOCK:
        shared = _ENVS.get(path)
        if shared is not None:
            shared.refs += 1
        return shared


def is_open(path: str) -> bool:
    """Whether this process holds the LMDB environment at `path` open (as a tier)."""
    return os.path.realpath(path) in _ENVS


def open_lmdb(
    path: str, *, map_size: int = 0, write: bool = True, durable: bool = True, create: bool = False
) -> lmdb.Environment:
    """The environment at `path` as every tiercache process opens it (`map_size` 0: the size
    recorded in it): `writemap` when writing, readahead off (see the package docstring),
    `durable`: sync and metasync at every commit. ConfigError when it cannot be opened."""
    try:
        return lmdb.open(
            path,
            map_size=map_size,
            subdir=True,
            max_dbs=len(DB_NAMES),
            mode=0o600,
            readonly=not write,
            writemap=write,
            sync=durable,
            metasync=durable,
            readahead=False,
            lock=True,
            max_readers=MAX_READERS,
            create=create,
        )
    except lmdb.Error as exc:
        raise ConfigError("path", f"{path}: cannot open as an LMDB environment: {exc}") from None


def _open_env(path: str, block_bytes: int, map_size: int, sync: str) -> SharedEnv:
    durable = sync == "always"
    env = open_lmdb(path, map_size=map_size, durable=durable, create=True)
    try:
        _reserve(path, map_size)
        env.reader_check()  # slots of processes that died in a read txn (see LMDBTier._txn)
        dbs = _init_store(env, path, block_bytes)
    except lmdb.Error as exc:
        env.close()
        raise ConfigError("path", damaged(path, exc)) from None
    except BaseException:
        env.close()
        raise
    return SharedEnv(path, env, dbs, block_bytes, map_size, durable)


def damaged(path: str, exc: lmdb.Error) -> str:
    """The message for an environment whose own pages are damaged (they carry no checksum:
    LMDB notices only what breaks its tree, e.g. MDB_CORRUPTED)."""
    return f"{path}: the LMDB environment is damaged ({exc}); remove the directory"


def _reserve(path: str, map_size: int) -> None:
    """Allocate the data file's disk blocks up to the map size, now: with `writemap`, a page
    fault on a full disk is a SIGBUS; reserved, a full disk shows here, as a ConfigError."""
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        no_room = f"{path} has no room for the LMDB map of this capacity ({map_size} bytes)"
        refused = store_dir.reserve(fd, 0, map_size, no_room=no_room)
        if refused is not None:
            log.warning("%s: cannot reserve disk space (%s); a full disk may crash", path, refused)
    finally:
        os.close(fd)


def _init_store(
    env: lmdb.Environment, path: str, block_bytes: int
) -> tuple[Any, Any, Any, Any, Any]:
    """Validate (or, in an empty environment, create) our metadata; the db handles. A store
    of an older version this build upgrades (`UPGRADES_FROM`) gets what it lacks, and its
    version, in the same transaction.

    In a write txn: LMDB's writer lock makes two processes creating one store at the same
    moment see each other's metadata instead of both writing it."""
    with env.begin(write=True) as txn:
        names = set(txn.cursor().iternext(values=False))
        if names - set(DB_NAMES) or (names and META_DB not in names):
            raise ConfigError(
                "path",
                f"{path} is an LMDB environment of another program (no tiercache "
                "metadata); use another directory",
            )
        meta_db = env.open_db(META_DB, txn=txn, create=not names)
        raw = txn.get(META_KEY, db=meta_db)
        if raw is None:
            if names:
                raise ConfigError("path", f"{path}: tiercache metadata is missing")
            meta = {"format": STORE_FORMAT, "version": STORE_VERSION, "block_bytes": block_bytes}
            txn.put(META_KEY, json.dumps(meta, sort_keys=True).encode(), db=meta_db)
        else:
            meta = parse_meta(path, raw)
            _META_FORMAT.check_block_bytes(meta["block_bytes"], block_bytes, path)
            if meta["version"] != STORE_VERSION:  # an older one: add the removal log
                meta = {**meta, "version": STORE_VERSION}
                txn.put(META_KEY, json.dumps(meta, sort_keys=True).encode(), db=meta_db)
                log.info("%s: upgraded the LMDB store to format version %d", path, STORE_VERSION)
        return (meta_db, *(env.open_db(n, txn=txn) for n in DB_NAMES[1:]))


def parse_meta(path: str, raw: bytes) -> dict[str, Any]:
    """The store's metadata (`store_dir.MetaFormat.parse`), or ConfigError naming `path`."""
    return _META_FORMAT.parse(raw, path)
