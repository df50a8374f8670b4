"""`LMDBTier`: blocks in an embedded LMDB environment, shareable between processes.

Primitives (on top of the `Tier` ABC):
- `write(slots, src, keys)`: one batched write transaction per call (split only when a call
  exceeds `txn_ops_for`, see `map_size_for`); zstd (2-byte-plane shuffle) compression runs
  before the transaction, on a thread pool, and is kept only when it pays.
- `read(slots, dst, keys)`: one read transaction, zero-copy `buffers=True` gets, header and
  key checks, checksum verified on every block; a missing or bad block is a failed position.
- `free(slots)`: the base free list; a block this tier stored since it opened is also
  deleted in the next write transaction or at `flush()` (a demotion planned with the
  eviction reads it first); blocks found at open or adopted are only forgotten.
- `take_gone(keys)`: which failed reads were plain misses (the store evicted the block).
- `recover()`: (key, slot) of every stored block, oldest first by the header's write seq.
- `flush()`, `close()`, `stats()`.

Layout. Databases "meta" (JSON: store format, version, block_bytes), "heads" (store key ->
the 64-byte `tiers.format` header) and "blocks" (store key -> stored payload), header and
payload put
in the same write transaction. Not one header+payload value: py-lmdb has no MDB_RESERVE, so
a joined value costs a 2 MiB staging copy per block; with two values the payload goes from
the caller's tensor straight into the map (2 MiB blocks, batches of 32, same run: 0.64 vs
0.82 of raw py-lmdb put throughput), and the open-time scan reads only header pages, never
payloads. The checksum still covers header and payload together.

The store key is the 8-byte namespace id (big-endian, as `tiers.format.namespace_id` gives
it) followed by the 16-byte block key (`store_key`): tenants with different namespaces hold
equal block keys side by side, a tier reads, counts, scans and deletes only keys under its
own namespace's prefix, and never touches another's. (Version 1 stores keyed by the block
key alone are refused at open, with the format-version error.)

Slots are logical handles: LMDB addresses blocks by key; the tier keeps a slot -> key map
only so that `free` knows which key to delete. A read goes by key.

Version 3 adds the "order" database (namespace prefix + order seq -> block key) and the
8-byte order seq after each header in "heads"; "meta" keeps each namespace's block count and
the environment's next seq. All change in the write transactions that change the blocks
(`_StoreTxn`), so capacity and eviction belong to the store: every transaction that stores
evicts its namespace's oldest blocks beyond the capacity, whichever process runs it.

Each tier also records its namespace's capacity and name and an attach entry (pid, host,
opened at) in "meta" at open, deleting the entry at close (tiers/lmdb_attach.py): what
`tiercache inspect` shows. A store without these records reads as "not recorded".

Opening deletes no good block: a tier indexes the newest `capacity` blocks of its namespace
from the order entries (headers only); only malformed entries under its own prefix are
dropped at open. A well-formed namespace is scanned in bulk (`_scan_fast`: two cursor runs
over its "order" and "heads" entries into arrays, checked as arrays, no payload looked at:
a read verifies it); any malformed entry sends the open to the entry-by-entry walk, which
finds and drops exactly those.

Readahead. The map is opened with `readahead=False` (MADV_RANDOM on the map). With the
kernel's readahead on, a page fault in the map read a whole window around the faulting page
(`read_ahead_kb`: 8 MiB on the machine of issue 35) into large page-cache folios. The cost
was threefold. (1) Fills slowed as the store grew: a write through the map dirties the whole
folio that holds the page, so each background sync wrote back nearly the whole file (1M
blocks of 4 KiB, issue 35: 50.7 GB written by the process for a 0.8 GB store, the last 100k
blocks 12.5 GB; with readahead off 7.7 GB, 0.7-0.9 GB per 100k blocks at every size).
(2) An open read 776 bytes per block from disk for 100k blocks instead of 202 (payload
pages came in with the header leaves). (3) A cold lookup read megabytes around each leaf.
Off, a fault reads its page alone; what wants more asks for it: `read` advises the kernel
of each multi-page payload before copying it (`lmdb_warm.will_need`), and a lazy open warms
the "heads" and "order" pages in the background (`lmdb_warm.warm_index`, never payloads),
so the first lookup of each key finds its index pages in the page cache.

Sharing. One `lmdb.Environment` per real path per process, reference counted (LMDB refuses a
second open of an environment in one process). Any number of processes may open and write
the same directory: LMDB's writer mutex serializes the write transactions and readers never
block. A process sees blocks another stored through `probe` on a lookup miss; a block another
process evicted reads as a plain miss (`take_gone`). A process that does not hold the store
as a tier (vLLM's scheduler) asks it through `LMDBProbe`: headers only, read-only.

Durability (`sync`): "always" opens the environment with sync and metasync (a write is
durable when it returns); "batch" commits without fsync, starts a background `env.sync` every
`SYNC_EVERY_TXNS` transactions or `SYNC_EVERY_S` seconds (writers do not wait for it) and
syncs in the foreground at `flush()`/`close()`; "never" syncs only at `close()`. The map is
opened with `writemap` (2x faster puts, shared/limits/lmdb_raw.py): with "batch"/"never" an
operating-system crash between syncs may damage the environment. Every block is
checksummed together with its key, so a damaged block reads as a miss, never as wrong
bytes; LMDB's own tree pages carry no checksum (damage there shows as LMDB errors).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, ClassVar

import lmdb
import numpy as np
import torch
import zstandard

from tiercache.errors import BlockCorruptError, ConfigError
from tiercache.tiers import lmdb_attach, lmdb_warm, store_dir
from tiercache.tiers.base import KEY_BYTES, check_blocks
from tiercache.tiers.format import (
    CODEC_RAW,
    CODEC_ZSTD_SHUFFLE2,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    BlockHeader,
    decode_header,
    decode_payload,
    encode_block,
    is_header_of,
    namespace_id,
    verify,
)
from tiercache.tiers.keyed import KeyedTier
from tiercache.tiers.store_dir import over_capacity, warn_over_capacity

log = logging.getLogger(__name__)

STORE_FORMAT = "tiercache-lmdb"
STORE_VERSION = 3  # bump when the environment layout (databases, metadata, keys) changes
NS_BYTES = 8  # the namespace-id prefix of every store key
SEQ_BYTES = 8  # the store's order sequence number, big-endian, after each header
META_DB, HEADS_DB, BLOCKS_DB, ORDER_DB = b"meta", b"heads", b"blocks", b"order"
DB_NAMES = (META_DB, HEADS_DB, BLOCKS_DB, ORDER_DB)
META_KEY = b"store"
SEQ_KEY = b"seq"  # meta: the next order sequence number of the environment
COUNT_PREFIX = b"count:"  # meta: + namespace prefix -> that namespace's block count
_OUR_FILES = frozenset({"data.mdb", "lock.mdb"})
_DIR_RULES = store_dir.DirRules("LMDB", _OUR_FILES)
# what becomes of a namespace's blocks beyond a tier's capacity at open (see _StoreTxn.evict)
_EVICTS_LATER = "the store evicts the %d oldest at its next write of this namespace"

COMPRESSIONS = ("none", "zstd")
SYNC_MODES = ("never", "batch", "always")
ZSTD_MIN_LEVEL = -(1 << 17)  # ZSTD_minCLevel(); python-zstandard does not export it
SYNC_EVERY_TXNS = 64
SYNC_EVERY_S = 1.0
MAX_READERS = 512  # reader-table slots: one per open read txn, across all processes
MIN_TXN_OPS = 64
MAX_TXN_OPS = 256
_RETRIES = 8
MAP_FULL_TRIES = 9  # a write that finds the map full waits 1+2+...+128 ms for readers to end
_PARALLEL_MIN_BYTES = 64 * 1024  # blocks at least this big are decoded on the thread pool


# Rows of `_scan_fast`: an "order" entry (key, value) and a "heads" entry (store key, the
# `tiers.format` header, the 8-byte order seq), little-endian fields as the header packs them.
_ORDER_ROW = np.dtype([("ns", "V8"), ("seq", ">u8"), ("key", f"V{KEY_BYTES}")])
_HEADS_ROW = np.dtype(
    [
        ("ns", "V8"),
        ("key", f"V{KEY_BYTES}"),
        ("magic", "V4"),
        ("version", "<u2"),
        ("codec", "u1"),
        ("reserved", "u1"),
        ("hkey", f"V{KEY_BYTES}"),
        ("hns", "<u8"),
        ("raw", "<u4"),
        ("stored", "<u4"),
        ("hseq", "<u8"),
        ("reserved2", "<u8"),
        ("sum", "<u8"),
        ("oseq", ">u8"),
    ]
)
assert _HEADS_ROW.itemsize == NS_BYTES + KEY_BYTES + HEADER_SIZE + SEQ_BYTES


def store_key(namespace: int, key: bytes) -> bytes:
    """The LMDB key of block `key` of the namespace with id `namespace`."""
    return namespace.to_bytes(NS_BYTES, "big") + key


def split_store_key(skey: bytes) -> tuple[int, bytes] | None:
    """(namespace id, block key) of a store key; None when it is not one."""
    if len(skey) != NS_BYTES + KEY_BYTES:
        return None
    return int.from_bytes(skey[:NS_BYTES], "big"), skey[NS_BYTES:]


def txn_ops_for(capacity_blocks: int) -> int:
    """Most block puts + deletes in one write transaction."""
    return min(MAX_TXN_OPS, max(MIN_TXN_OPS, math.ceil(capacity_blocks / 8)))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def head_seq(head: bytes | memoryview | None) -> int | None:
    """The order sequence number stored after a header; None when there is none."""
    if head is None or len(head) != HEADER_SIZE + SEQ_BYTES:
        return None
    return int.from_bytes(head[HEADER_SIZE:], "big")


def _u64(raw: bytes | memoryview | None) -> int:
    return 0 if raw is None or len(raw) != 8 else int.from_bytes(raw, "big")


def map_size_for(capacity_blocks: int, block_bytes: int, page_size: int | None = None) -> int:
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
    SIGBUS, not an error). K is at most `MAX_TXN_OPS`: before version 3 it grew with the
    capacity (C/8) and the map with it, 1.55x the payload with 64 KiB blocks.
    """
    page = page_size or max(4096, os.sysconf("SC_PAGE_SIZE"))
    node = 8 + NS_BYTES + KEY_BYTES + block_bytes  # a leaf node holding the payload inline
    inline = node <= (page - 16) // 2  # LMDB's largest inline node (me_nodemax)
    payload = 2 * node if inline else math.ceil((block_bytes + 16) / page) * page
    per_block = payload + ENTRY_BYTES
    return (capacity_blocks + 3 * txn_ops_for(capacity_blocks) + 16) * per_block + (8 << 20)


ENTRY_BYTES = 512


_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(kind: str = "codec") -> ThreadPoolExecutor:
    """ "codec": threads for zstd and payload copies (both release the GIL; xxhash does not,
    so one thread hashes while another copies); "sync": one thread for the background
    env.sync of sync = "batch" (py-lmdb releases the GIL during it)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(kind)
        if pool is None:
            workers = min(4, os.cpu_count() or 1) if kind == "codec" else 1
            pool = _POOLS[kind] = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix=f"tiercache-lmdb-{kind}"
            )
        return pool


def check_settings(
    compression: object, level: object, element_size: object, sync: object, where: str = ""
) -> None:
    """Value checks shared by the constructor and `validate_options` (ConfigError)."""
    p = f"{where}." if where else ""
    if compression not in COMPRESSIONS:
        raise ConfigError(f"{p}compression", f"expected one of {COMPRESSIONS}, got {compression!r}")
    top = zstandard.MAX_COMPRESSION_LEVEL
    if isinstance(level, bool) or not isinstance(level, int) or not ZSTD_MIN_LEVEL <= level <= top:
        raise ConfigError(
            f"{p}level", f"expected a zstd level {ZSTD_MIN_LEVEL}..{top}, got {level!r}"
        )
    if isinstance(element_size, bool) or element_size not in (1, 2):
        raise ConfigError(
            f"{p}element_size",
            f"expected 1 (no shuffle) or 2 (byte-plane shuffle, bf16/fp16), got {element_size!r}",
        )
    if sync not in SYNC_MODES:
        raise ConfigError(f"{p}sync", f"expected one of {SYNC_MODES}, got {sync!r}")


# -- the directory and the shared environment ------------------------------------------------


def prepare_dir(path: object) -> str:
    """Check (or create, 0700) the environment directory; its real path, or ConfigError
    (`store_dir.prepare_dir`: only LMDB's own files may be in it)."""
    return store_dir.prepare_dir(path, _DIR_RULES)


class _SharedEnv:
    """One open environment per real path in this process, shared by the tiers over it."""

    def __init__(
        self,
        path: str,
        env: lmdb.Environment,
        dbs: tuple[Any, Any, Any, Any],
        block_bytes: int,
        map_size: int,
        durable: bool,
    ) -> None:
        self.path, self.env = path, env
        self.meta, self.heads, self.blocks, self.order = dbs
        self.block_bytes = block_bytes
        self.map_size = map_size
        self.durable = durable  # opened with sync + metasync: every commit is durable
        self.refs = 0
        self.write_lock = threading.Lock()  # one write txn at a time from this process
        self.state_lock = threading.Lock()  # pending, seq, sync counters
        # store key -> the order seq of the entry to delete (None: whatever is there): blocks
        # found corrupt or malformed, deleted in the next write txn (see LMDBTier.read).
        self.pending: dict[bytes, int | None] = {}
        self.seq = 0
        self.txns_since_sync = 0
        self.last_sync = time.monotonic()
        self.bg_sync: Future[None] | None = None
        self.warm: threading.Thread | None = None  # the index warm pass (lmdb_warm), once
        self.warm_report: dict[str, float] = {}

    def start_warm(self) -> None:
        """Warm the "heads" and "order" pages (never payloads) on a daemon thread, once per
        environment in this process: the first lookup of each key after a lazy open then
        finds its pages in the page cache instead of reading them one at a time."""
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


_ENVS: dict[str, _SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def _attach(path: str, block_bytes: int, map_size: int, sync: str) -> _SharedEnv:
    with _ENVS_LOCK:
        shared = _ENVS.get(path)
        if shared is None:
            shared = _ENVS[path] = _open_env(path, block_bytes, map_size, sync)
        else:
            _check_block_bytes(path, shared.block_bytes, block_bytes)
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


def _detach(shared: _SharedEnv) -> None:
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


def _check_block_bytes(path: str, stored: int, wanted: int) -> None:
    if stored != wanted:
        raise ConfigError(
            "block_bytes",
            f"{path} holds blocks of {stored} bytes; this tier was opened with "
            f"block_bytes={wanted} (use the same block size or another path)",
        )


def _open_env(path: str, block_bytes: int, map_size: int, sync: str) -> _SharedEnv:
    durable = sync == "always"
    try:
        env = lmdb.open(
            path,
            map_size=map_size,
            subdir=True,
            max_dbs=len(DB_NAMES),
            mode=0o600,
            writemap=True,
            sync=durable,
            metasync=durable,
            readahead=False,  # see the module docstring ("Readahead")
            lock=True,
            max_readers=MAX_READERS,
            create=True,
        )
    except lmdb.Error as exc:
        raise ConfigError("path", f"{path}: cannot open as an LMDB environment: {exc}") from None
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
    return _SharedEnv(path, env, dbs, block_bytes, map_size, durable)


def damaged(path: str, exc: lmdb.Error) -> str:
    """The message for an environment whose own pages are damaged (they carry no checksum:
    LMDB notices only what breaks its tree, e.g. MDB_CORRUPTED)."""
    return f"{path}: the LMDB environment is damaged ({exc}); remove the directory"


def _reserve(path: str, map_size: int) -> None:
    """Allocate the data file's disk blocks up to the map size, now. With `writemap` LMDB
    writes through a shared mapping of a sparse file, and on a full disk the page fault that
    would allocate a block kills the process with SIGBUS (seen on a 3 MiB tmpfs by
    tests/test_campaign_diskfull.py). Reserved, a full disk shows here, as a ConfigError."""
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        no_room = f"{path} has no room for the LMDB map of this capacity ({map_size} bytes)"
        refused = store_dir.reserve(fd, 0, map_size, no_room=no_room)
        if refused is not None:
            log.warning("%s: cannot reserve disk space (%s); a full disk may crash", path, refused)
    finally:
        os.close(fd)


def _init_store(env: lmdb.Environment, path: str, block_bytes: int) -> tuple[Any, Any, Any, Any]:
    """Validate (or, in an empty environment, create) our metadata; the db handles.

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
            meta = _parse_meta(path, raw)
            _check_block_bytes(path, meta["block_bytes"], block_bytes)
        return (meta_db, *(env.open_db(n, txn=txn) for n in (HEADS_DB, BLOCKS_DB, ORDER_DB)))


def _parse_meta(path: str, raw: bytes) -> dict[str, Any]:
    """The store's metadata (`store_dir.parse_store_meta`), or ConfigError naming `path`."""
    return store_dir.parse_store_meta(
        raw, where=path, kind="LMDB", store_format=STORE_FORMAT, version=STORE_VERSION
    )


def _under(cursor: Any, prefix: bytes, values: bool) -> Iterator[Any]:
    """(key, value) - or, without `values`, the key - of every entry of `cursor`'s database
    whose key starts with `prefix`, in key order (keys as bytes)."""
    if not cursor.set_range(prefix):
        return
    for item in cursor.iternext(values=values):
        k = bytes(item[0] if values else item)
        if not k.startswith(prefix):
            return
        yield (k, item[1]) if values else k


class _StoreTxn:
    """The bookkeeping of one write transaction, shared by every process: blocks put and
    deleted with their "order" entries (namespace prefix + order seq -> block key, oldest
    first), each namespace's block count and the environment's next order seq in "meta"."""

    def __init__(self, txn: lmdb.Transaction, meta: Any, heads: Any, blocks: Any, order: Any):
        self.txn, self.meta, self.heads, self.blocks, self.order = txn, meta, heads, blocks, order
        self.seq = self.seq0 = _u64(txn.get(SEQ_KEY, db=meta))
        self.counts: dict[bytes, int] = {}  # namespace prefix -> its count (read when used)
        self.dirty: set[bytes] = set()
        self.evicted = 0

    def count(self, nsb: bytes) -> int:
        c = self.counts.get(nsb)
        if c is None:
            c = self.counts[nsb] = _u64(self.txn.get(COUNT_PREFIX + nsb, db=self.meta))
        return c

    def _add(self, nsb: bytes, d: int) -> None:
        self.counts[nsb] = max(0, self.count(nsb) + d)
        self.dirty.add(nsb)

    def _drop(self, sk: bytes, head: bytes, order_too: bool = True) -> None:
        txn = self.txn
        txn.delete(sk, db=self.heads)
        txn.delete(sk, db=self.blocks)
        seq = head_seq(head)
        if order_too and seq is not None:
            ok = sk[:NS_BYTES] + seq_bytes(seq)
            if txn.get(ok, db=self.order) == sk[NS_BYTES:]:  # a copied header points elsewhere
                txn.delete(ok, db=self.order)
        self._add(sk[:NS_BYTES], -1)

    def delete(self, sk: bytes, want: int | None) -> None:
        """Delete the block under `sk`; with `want`, only if its order seq is still that (a
        block stored again since it was found bad stays)."""
        head = self.txn.get(sk, db=self.heads)
        if head is None:
            self.txn.delete(sk, db=self.blocks)  # an orphan payload: never counted
        elif want is None or head_seq(head) == want:
            self._drop(sk, head)

    def put(self, sk: bytes, header: bytes, payload: Any) -> None:
        txn, nsb = self.txn, sk[:NS_BYTES]
        old = head_seq(txn.get(sk, db=self.heads))
        if old is None:
            self._add(nsb, 1)  # (a malformed old header was never counted either)
        else:
            txn.delete(nsb + seq_bytes(old), db=self.order)
        sb = seq_bytes(self.seq)
        self.seq += 1
        txn.put(sk, header + sb, db=self.heads)
        txn.put(sk, payload, db=self.blocks)
        txn.put(nsb + sb, sk[NS_BYTES:], db=self.order)

    def evict(self, nsb: bytes, capacity: int) -> None:
        """Delete the namespace's oldest blocks while it holds more than `capacity`."""
        if self.count(nsb) <= capacity:
            return
        cur = self.txn.cursor(db=self.order)
        if not cur.set_range(nsb):
            return
        while self.counts[nsb] > capacity:
            ok = cur.key()
            if not ok.startswith(nsb) or len(ok) != NS_BYTES + SEQ_BYTES:
                break  # the count ran ahead of the entries (damage): nothing more to evict
            sk = nsb + cur.value()
            cur.delete()  # the cursor moves to the next entry
            head = self.txn.get(sk, db=self.heads)
            if head is not None and head_seq(head) == int.from_bytes(ok[NS_BYTES:], "big"):
                self._drop(sk, head, order_too=False)
                self.evicted += 1

    def finish(self) -> None:
        if self.seq != self.seq0:
            self.txn.put(SEQ_KEY, self.seq.to_bytes(8, "big"), db=self.meta)
        for nsb in self.dirty:
            self.txn.put(COUNT_PREFIX + nsb, self.counts[nsb].to_bytes(8, "big"), db=self.meta)


# -- the tier --------------------------------------------------------------------------------


class LMDBTier(KeyedTier):
    """Blocks keyed by block key in LMDB; persistent and shareable between processes."""

    kind: ClassVar[str] = "lmdb"
    store_label: ClassVar[str] = "LMDB"
    persistent: ClassVar[bool] = True
    shared: ClassVar[bool] = True
    OPTIONS: ClassVar = {
        "path": str,
        "compression": str,
        "level": int,
        "element_size": int,
        "sync": str,
    }

    def __init__(
        self,
        *,
        name: str = "lmdb",
        block_bytes: int,
        capacity_blocks: int,
        path: str,
        compression: str = "zstd",
        level: int = 1,
        element_size: int = 2,
        sync: str = "batch",
        namespace: str = "",
        lazy: bool = False,
    ) -> None:
        """`lazy`: index nothing at open when the store is well formed (the manager finds
        each block by `probe` on its first lookup, as it finds other processes' blocks), so
        the open costs neither time nor RAM per block; else index the newest `capacity`."""
        check_settings(compression, level, element_size, sync)
        super().__init__(
            name=name,
            block_bytes=block_bytes,
            capacity_blocks=capacity_blocks,
            compression=compression,
            level=level,
        )
        self._element_size = element_size
        self._sync = sync
        self._ns = namespace_id(namespace)
        self._nsb = self._ns.to_bytes(NS_BYTES, "big")  # prefix of every store key of ours
        self._txn_ops = txn_ops_for(capacity_blocks)
        self._lazy = lazy
        self.open_report: dict[str, int] = {}  # what _scan found: dropped, recovered blocks
        self._counts = dict.fromkeys(
            (
                "blocks_written",
                "raw_bytes",
                "stored_bytes",
                "blocks_read",
                "read_failures",
                "blocks_gone",
                "store_evictions",
                "dead_readers_cleared",
                "map_full_retries",
                "malformed_dropped",
            ),
            0,
        )
        self._counts_lock = threading.Lock()
        self._path = prepare_dir(path)
        map_size = map_size_for(capacity_blocks, block_bytes)
        self._shared = _attach(self._path, block_bytes, map_size, sync)
        self._token: bytes | None = None  # our attach entry (tiers/lmdb_attach.py)
        try:
            self._scan()
            self._register(namespace)
        except BaseException:
            self._closed = True
            _detach(self._shared)
            raise

    @classmethod
    def validate_options(cls, options: Mapping[str, Any], where: str) -> None:
        super().validate_options(options, where)
        if not options.get("path"):
            raise ConfigError(f"{where}.path", "required: the directory of the LMDB store")
        o = options
        check_settings(
            o.get("compression", "zstd"),
            o.get("level", 1),
            o.get("element_size", 2),
            o.get("sync", "batch"),
            where,
        )

    @classmethod
    def from_config(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> LMDBTier:
        o = cfg.options
        try:
            return cls(
                name=cfg.name,
                block_bytes=block_bytes,
                path=o["path"],
                capacity_blocks=cfg.capacity_in_blocks(block_bytes),
                compression=o.get("compression", "zstd"),
                level=o.get("level", 1),
                element_size=o.get("element_size", 2),
                sync=o.get("sync", "batch"),
                namespace=namespace,
                lazy=True,
            )
        except ConfigError as exc:
            if exc.field in ("path", "block_bytes", "capacity"):
                raise ConfigError(f"{cfg.field}.{exc.field}", exc.problem) from None
            raise

    # -- introspection ---------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._path

    @property
    def map_size(self) -> int:
        return self._shared.map_size

    def stats(self) -> dict[str, Any]:
        """This tier object's counters: bytes written raw vs stored (`compression_ratio`),
        blocks read and failed reads; plus pending deletes and the environment's size."""
        with self._counts_lock:
            out: dict[str, Any] = dict(self._counts)
        stored = out["stored_bytes"]
        out["compression_ratio"] = out["raw_bytes"] / stored if stored else 1.0
        out["pending_deletes"] = len(self._shared.pending)
        out["map_size"] = self._shared.map_size
        if not self._closed:
            info, st = self._shared.env.info(), self._shared.env.stat()
            out["env_bytes"] = (info["last_pgno"] + 1) * st["psize"]
        out.update({f"index_warm_{k}": v for k, v in self._shared.warm_report.items()})
        return out

    # -- slots -----------------------------------------------------------------------------
    def allocate(self, keys: Sequence[bytes]) -> list[int] | None:
        slots = super().allocate(keys)
        if slots:
            self._slot_key.update(zip(slots, keys, strict=True))
            self._own.update(slots)
            self._unpend(keys)
        return slots

    def free(self, slots: Sequence[int]) -> None:
        """Return slots. A block this tier stored since it opened is deleted at the next
        write txn or flush (not now: a demotion planned with the eviction still reads it);
        one found at open or adopted from another process is only forgotten: the store's
        shared capacity decides when it goes (see the module docstring)."""
        gone: dict[bytes, int | None] = {}
        for s in slots:
            k = self._slot_key.pop(s, None)
            if s in self._own:
                self._own.discard(s)
                if k is not None:
                    gone[self._nsb + k] = None
        if gone:
            with self._shared.state_lock:
                self._shared.pending.update(gone)
        super().free(slots)

    def probe(self, keys: Sequence[bytes]) -> int:
        """Leading `keys` with a well-formed header of this namespace in the environment
        (stored by another process since open); stops at a key this process is deleting."""
        if self._closed or not keys:
            return 0
        shared = self._shared
        with shared.state_lock:
            pending = set(shared.pending) if shared.pending else set()
        try:
            txn = self._begin(write=False)
        except OSError:
            return 0
        try:
            # A malformed entry met here is damage the (lazy) open did not scan: dropped.
            return _leading_heads(
                txn,
                shared.heads,
                keys,
                self._ns,
                self.block_bytes,
                pending,
                shared.order,
                self._drop_malformed,
            )
        finally:
            txn.abort()

    def _drop_malformed(self, sk: bytes, head: bytes) -> None:
        """A probe found a malformed header (damage): its entries go at the next write
        transaction or flush, counted (`malformed_dropped`), as the eager open drops them."""
        log.warning("%s: dropping a malformed entry found by a lookup", self._path)
        with self._shared.state_lock:
            self._shared.pending[sk] = head_seq(head)
        with self._counts_lock:
            self._counts["malformed_dropped"] += 1

    @classmethod
    def open_probe(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> LMDBProbe:
        return LMDBProbe(cfg.options["path"], block_bytes, namespace=namespace)

    def _unpend(self, keys: Iterable[bytes]) -> None:
        """Keys stored again are live: no pending delete may remove them any more."""
        shared = self._shared
        with shared.state_lock:
            if shared.pending:
                for k in keys:
                    shared.pending.pop(self._nsb + k, None)

    # -- write -----------------------------------------------------------------------------
    def write(
        self, slots: Sequence[int], src: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> None:
        n = len(slots)
        check_blocks(src, n, self.block_bytes, "src")
        keys = self._check_keys(keys, n)
        self._check_open()
        if n == 0:
            return
        if src.device.type != "cpu":
            src = src.cpu()
        rows = src.numpy()
        replaced: dict[bytes, int | None] = {}
        for s, k in zip(slots, keys, strict=True):
            old = self._slot_key.get(s)
            if old != k:
                if old is not None and s in self._own:
                    replaced[self._nsb + old] = None
                self._slot_key[s] = k
        self._own.update(slots)
        if replaced:
            with self._shared.state_lock:
                self._shared.pending.update(replaced)
        self._unpend(keys)
        seq0 = self._shared.next_seq(n)

        def encode(i: int) -> tuple[bytes, bytes | memoryview]:
            return encode_block(
                keys[i],
                rows[i],
                namespace=self._ns,
                seq=seq0 + i,
                compression=self._compression,
                level=self._level,
                element_size=self._element_size,
                compressor=self._compressor(),
            )

        if self._compression == "zstd":
            # Compress before the write txn: the writer lock is held for puts only.
            encoded = self._map(encode, n, parallel=self.block_bytes >= _PARALLEL_MIN_BYTES)
            self._commit([self._nsb + k for k in keys], encoded.__getitem__)
        else:
            # Raw: the header's checksum pass pulls the row into cache just before LMDB
            # copies it into the map; the payload is put from the caller's tensor as is.
            self._commit([self._nsb + k for k in keys], encode)

    def _commit(self, skeys: Sequence[bytes], encoded: Callable[[int], tuple[bytes, Any]]) -> None:
        """Apply the pending deletes, then put each (header, payload) under its store key
        (`skeys`, namespace-prefixed), at most `txn_ops` of either per txn (one txn per call
        in practice); each txn also evicts this namespace's oldest blocks beyond its capacity.
        Raises OSError; pending deletes stay pending unless their txn committed."""
        shared = self._shared
        with shared.write_lock:
            with shared.state_lock:
                ops: list[tuple[bytes, int]] = [(k, -1) for k in shared.pending]
            ops += [(k, i) for i, k in enumerate(skeys)]
            stored = 0
            for start in range(0, len(ops), self._txn_ops):
                chunk = ops[start : start + self._txn_ops]
                done = [k for k, i in chunk if i < 0]
                try:
                    stored += self._txn_clearing(chunk, encoded)
                except lmdb.Error as exc:
                    if not done or isinstance(exc, lmdb.MapFullError):
                        raise self._os_error("write", exc) from None  # deletes stay pending
                    # A delete LMDB cannot do (a damaged overflow page: MDB_CORRUPTED) must
                    # not fail this and every later write: delete one key per txn, give up
                    # on those that fail, then retry the puts alone.
                    self._delete_each(done)
                    done = []  # _delete_each settled them
                    try:
                        stored += self._txn([op for op in chunk if op[1] >= 0], encoded)
                    except lmdb.Error as exc2:
                        raise self._os_error("write", exc2) from None
                if done:
                    self._settle(done)
                self._after_commit()
        with self._counts_lock:
            self._counts["blocks_written"] += len(skeys)
            self._counts["raw_bytes"] += len(skeys) * self.block_bytes
            self._counts["stored_bytes"] += stored

    def _settle(self, done: Iterable[bytes]) -> None:
        with self._shared.state_lock:
            for k in done:
                self._shared.pending.pop(k, None)

    def _txn(
        self, chunk: Sequence[tuple[bytes, int]], encoded: Callable[[int], tuple[bytes, Any]]
    ) -> int:
        """One write txn: delete (i < 0) or put `encoded(i)`, keeping each namespace's block
        count and the order database in step, then evict this namespace's oldest blocks
        beyond `capacity_blocks`; the payload bytes put. Aborts and re-raises on any error."""
        sh = self._shared
        stored = 0
        txn = self._begin(write=True)
        try:
            store = _StoreTxn(txn, sh.meta, sh.heads, sh.blocks, sh.order)
            with sh.state_lock:
                pending = dict(sh.pending)
            for k, i in chunk:
                if i < 0:
                    store.delete(k, pending.get(k))
                else:
                    header, payload = encoded(i)
                    store.put(k, header, payload)
                    stored += len(payload)
            if any(i >= 0 for _, i in chunk):  # deletes alone never make room to trim
                store.evict(self._nsb, self.capacity_blocks)
            store.finish()
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        if store.evicted:
            with self._counts_lock:
                self._counts["store_evictions"] += store.evicted
        return stored

    def _txn_clearing(
        self, chunk: Sequence[tuple[bytes, int]], encoded: Callable[[int], tuple[bytes, Any]]
    ) -> int:
        """`_txn`, again while the map is full for a moment. A reader pins the pages freed
        after its snapshot: a process SIGKILLed inside a read txn leaves its slot in the
        reader table and pins them for good (every later write of every process failed with
        a full map; tests/test_campaign_fleet.py found it), so dead readers are cleared; a
        live reader of another process, descheduled mid-txn while others write, pins them
        until it ends, so the write waits for it (at most ~255 ms) before it fails."""
        for attempt in range(MAP_FULL_TRIES):
            try:
                return self._txn(chunk, encoded)
            except lmdb.MapFullError:
                if attempt == MAP_FULL_TRIES - 1:
                    raise
                cleared = self._shared.env.reader_check()
                if cleared:
                    log.warning("%s: cleared %d readers of dead processes", self._path, cleared)
                with self._counts_lock:
                    self._counts["dead_readers_cleared"] += cleared
                    self._counts["map_full_retries"] += 1
                if not cleared:
                    time.sleep(0.001 * 2**attempt)
        raise AssertionError("unreachable")

    def _delete_each(self, keys: Sequence[bytes]) -> None:
        """Delete keys one txn each; a key LMDB cannot delete stays (a leak of its pages, its
        block already a counted miss) and leaves the pending deletes; one that failed for
        want of map space stays pending (write lock held)."""
        done = []
        for k in keys:
            try:
                self._txn([(k, -1)], lambda i: (b"", b""))
            except lmdb.MapFullError:
                continue
            except lmdb.Error as exc:
                log.warning("%s: cannot delete damaged entry %s: %s", self._path, k.hex(), exc)
            done.append(k)
        self._settle(done)

    def _after_commit(self) -> None:
        shared = self._shared
        if self._sync == "never" or shared.durable:
            return
        if self._sync == "always":  # an env opened by a "batch" tier of this process
            self._env_sync()
            return
        with shared.state_lock:
            shared.txns_since_sync += 1
            due = (
                shared.txns_since_sync >= SYNC_EVERY_TXNS
                or time.monotonic() - shared.last_sync >= SYNC_EVERY_S
            )
            if due and (shared.bg_sync is None or shared.bg_sync.done()):
                shared.txns_since_sync = 0
                shared.last_sync = time.monotonic()
                shared.bg_sync = _pool("sync").submit(shared.background_sync)

    def _env_sync(self) -> None:
        shared = self._shared
        try:
            shared.wait_sync()
            shared.env.sync(True)
        except lmdb.Error as exc:
            raise self._os_error("sync", exc) from None
        with shared.state_lock:
            shared.txns_since_sync = 0
            shared.last_sync = time.monotonic()

    # -- read ------------------------------------------------------------------------------
    def read(
        self, slots: Sequence[int], dst: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> list[int]:
        """Read blocks by key (slots are only handles here); a missing key or a foreign or
        corrupt block is a failed position. A missing key is a plain miss (the store evicted
        it, see `take_gone`); a bad block is deleted at the next write txn. OSError when no
        read txn can be had."""
        n = len(slots)
        check_blocks(dst, n, self.block_bytes, "dst")
        keys = self._check_keys(keys, n)
        self._check_open()
        if n == 0:
            return []
        out = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=torch.uint8)
        out_np = out.numpy()
        heads, nsb = self._shared.heads, self._nsb
        failed: list[int] = []
        gone: list[bytes] = []
        bad: dict[bytes, int | None] = {}  # store key -> order seq: deleted at the next write
        found: list[tuple[int, bytes, memoryview, memoryview]] = []
        txn = self._begin(write=False)
        try:
            for i, k in enumerate(keys):
                sk = nsb + k
                try:
                    h, v = txn.get(sk, db=heads), txn.get(sk)
                except lmdb.Error:
                    failed.append(i)
                    continue
                if h is None:
                    failed.append(i)
                    if v is None:
                        gone.append(k)  # evicted by the store (this or another process)
                    else:
                        bad[sk] = None  # a payload without its header
                elif v is None:
                    failed.append(i)
                    bad[sk] = head_seq(h)
                else:
                    found.append((i, k, h, v))
            lmdb_warm.will_need(f[3] for f in found)  # readahead is off: see _open_env
            parallel = self.block_bytes >= _PARALLEL_MIN_BYTES
            ok = self._map(lambda j: self._decode(found[j], out_np), len(found), parallel)
            for (i, k, h, _), good in zip(found, ok, strict=True):
                if not good:
                    failed.append(i)
                    bad[nsb + k] = head_seq(h)
        finally:
            txn.abort()  # the zero-copy views die here, after every copy above finished
        if out is not dst:
            dst.copy_(out)
        failed.sort()
        if bad:
            with self._shared.state_lock:
                self._shared.pending.update(bad)
        with self._counts_lock:
            self._counts["blocks_read"] += n - len(failed)
            self._counts["read_failures"] += len(failed) - len(gone)
            self._counts["blocks_gone"] += len(gone)
        self._note_gone(gone)
        return failed

    def _header(self, key: bytes, head: memoryview, payload_len: int) -> BlockHeader:
        h = decode_header(head)
        if h.key != key:
            raise BlockCorruptError("header key differs from the LMDB key")
        if h.namespace_id != self._ns:
            raise BlockCorruptError("block of another namespace")
        if h.raw_len != self.block_bytes or payload_len != h.stored_len:
            raise BlockCorruptError("length mismatch")
        return h

    def _decode(self, item: tuple[int, bytes, memoryview, memoryview], out: np.ndarray) -> bool:
        """Check and copy one block into its row of `out`; False if it is not a good block
        of its key."""
        i, key, head, v = item
        try:
            h = self._header(key, head, len(v))
            if h.codec == CODEC_RAW:
                # Copy, then checksum the copy while it is in cache: one pass over memory,
                # and what is verified is exactly what the caller gets.
                np.copyto(out[i], np.frombuffer(v, dtype=np.uint8))
                verify(h, out[i])
            else:
                dz = self._decompressor()
                decode_payload(h, v, out[i], decompressor=dz)
        except BlockCorruptError:
            return False
        return True

    def _map(self, fn: Callable[[int], Any], n: int, parallel: bool) -> list[Any]:
        """`fn` over range(n), on the codec pool when asked and there is more than one.
        Waits for every call before returning or raising: reads hand the pool zero-copy
        views that die with their transaction."""
        if n < 2 or not parallel:
            return [fn(i) for i in range(n)]
        # One contiguous chunk per thread, the caller's thread taking the first: a future per
        # block cost more than the copy and checksum of a 64 KiB block (measured 0.25x raw
        # py-lmdb reads with a future per block, in tiercache/benchharness/baselines.py).
        pool = _pool()
        parts = min(n, pool._max_workers + 1)
        bounds = [(n * w // parts, n * (w + 1) // parts) for w in range(parts)]

        def run(a: int, b: int) -> list[Any]:
            return [fn(i) for i in range(a, b)]

        futures = [pool.submit(run, a, b) for a, b in bounds[1:]]
        try:
            out = run(*bounds[0])
        finally:
            wait(futures)
        for f in futures:
            out += f.result()
        return out

    # -- recovery and lifecycle ------------------------------------------------------------
    def _scan(self) -> None:
        """Index this namespace's newest `capacity` blocks, walking its "order" entries newest
        first and checking each header (64 + 8 bytes, in leaf pages) and its payload's length
        (from the payload's leaf node: py-lmdb's zero-copy get points into the map and
        touches no payload page). Other namespaces' entries and older blocks of this one are
        never visited. Only when the databases disagree in size (an entry without its
        partner: damage, or another program) are this namespace's entries scanned to find
        and drop the malformed ones. Opening deletes no good block."""
        shared, nsb = self._shared, self._nsb
        kept: list[bytes] = []  # block keys, newest first
        bad: dict[bytes, int | None] = {}
        fast: list[bytes] | None = None
        txn = self._begin(write=False)
        try:
            sizes = [txn.stat(db)["entries"] for db in (shared.heads, shared.blocks)]
            sizes.append(txn.stat(shared.order)["entries"])
            count = _u64(txn.get(COUNT_PREFIX + nsb, db=shared.meta))
            next_seq = _u64(txn.get(SEQ_KEY, db=shared.meta))
            if len(set(sizes)) > 1:
                bad.update(self._malformed(txn))
            elif self._lazy:  # well formed: nothing to index (see __init__)
                self._open_lazily(count, next_seq)
                return
            fast = None if bad else self._scan_fast(txn)
            cur = txn.cursor(db=shared.order)
            if fast is not None:
                kept, at = fast, None  # newest first, like the walk below
            elif nsb == b"\xff" * NS_BYTES:
                at = cur.last()
            elif cur.set_range((int.from_bytes(nsb, "big") + 1).to_bytes(NS_BYTES, "big")):
                at = cur.prev()  # the last entry before the next namespace's first
            else:
                at = cur.last()
            while at and len(kept) < self.capacity_blocks:
                ok = bytes(cur.key())
                if not ok.startswith(nsb):
                    break
                key, sk = bytes(cur.value()), nsb + bytes(cur.value())
                at = cur.prev()
                head = txn.get(sk, db=shared.heads)
                if head is None or sk in bad:
                    continue  # a stale order entry (the next eviction passing it drops it)
                if head_seq(head) != int.from_bytes(ok[NS_BYTES:], "big"):
                    bad[sk] = head_seq(head)  # the entries disagree: damage (the seq is not
                    continue  # covered by the checksum), never written so by a tier
                v = txn.get(sk)
                try:
                    if v is None or len(key) != KEY_BYTES:
                        raise BlockCorruptError("no payload")
                    self._header(key, head, len(v))
                except BlockCorruptError:
                    bad[sk] = head_seq(head)
                    continue
                kept.append(key)
        except lmdb.Error as exc:
            raise ConfigError("path", damaged(self._path, exc)) from None
        finally:
            txn.abort()
        if bad:
            log.warning("%s: dropping %d malformed entries found at open", self._path, len(bad))
            with shared.state_lock:
                shared.pending.update(bad)
            self._commit([], lambda i: (b"", b""))
        excess = over_capacity(count - len(bad), self.capacity_blocks)
        then = "indexing the newest; " + _EVICTS_LATER
        warn_over_capacity(log, self._path, count, self.capacity_blocks, excess, then)
        self.open_report = {
            "bulk_scan": int(fast is not None),
            "blocks_dropped": len(bad),
            "blocks_over_capacity": excess,
            "blocks_recovered": len(kept),
        }
        with shared.state_lock:
            shared.seq = max(shared.seq, next_seq)
        kept.reverse()
        self._take_found(kept)

    def _open_lazily(self, count: int, next_seq: int) -> None:
        """`_scan` of a well-formed store by a lazy tier: index nothing (lookups find
        blocks by `probe`; the store's capacity evicts its oldest beyond `capacity` at its
        next write of this namespace, as it does whoever writes)."""
        excess = over_capacity(count, self.capacity_blocks)
        warn_over_capacity(log, self._path, count, self.capacity_blocks, excess, _EVICTS_LATER)
        self.open_report = {
            "bulk_scan": 0,
            "lazy": 1,
            "blocks_dropped": 0,
            "blocks_over_capacity": excess,
            "blocks_recovered": 0,
            "blocks_in_store": count,
        }
        if count:
            self._shared.start_warm()
        with self._shared.state_lock:
            self._shared.seq = max(self._shared.seq, next_seq)

    def _scan_fast(self, txn: lmdb.Transaction) -> list[bytes] | None:
        """`_scan`'s walk for a well-formed namespace, in bulk: its "order" and "heads"
        entries are read by two cursor runs into fixed-width arrays and checked as arrays
        (every header's fields, and each header's order seq naming an order entry of its
        key); no payload is looked at (a read verifies it). The newest `capacity` block
        keys, newest first; None, and the caller walks entry by entry, when any entry is
        malformed (then `_scan` finds and drops exactly those, as before)."""
        shared, nsb = self._shared, self._nsb

        def run(db: Any, klen: int, vlen: int) -> bytes | None:
            """The namespace's entries of `db`, each key + value copied out in runs of
            4096 (holding py-lmdb's buffers instead measured 2.5x slower), joined; None when
            one has another length."""
            cur = txn.cursor(db=db)
            if not cur.set_range(nsb):
                return b""
            parts: list[bytes] = []
            it = cur.iternext(keys=True, values=True)
            while True:  # the run that passes our prefix is the last
                got = [
                    bytes(k) + bytes(v) if len(k) == klen else b""
                    for k, v in itertools.islice(it, 4096)
                ]
                if set(map(len, got)) - {klen + vlen}:
                    return None
                parts.append(b"".join(got))
                if len(got) < 4096 or got[-1][:NS_BYTES] != nsb:
                    break
            rows = np.frombuffer(b"".join(parts), dtype=f"V{klen + vlen}")
            ours = rows.view(np.uint8).reshape(len(rows), klen + vlen)[:, :NS_BYTES]
            mine = (ours == np.frombuffer(nsb, dtype=np.uint8)).all(axis=1)
            end = len(rows) if mine.all() else int(np.argmin(mine))  # sorted: a prefix
            return rows[:end].tobytes()

        order = run(shared.order, NS_BYTES + SEQ_BYTES, KEY_BYTES)
        heads = run(shared.heads, NS_BYTES + KEY_BYTES, HEADER_SIZE + SEQ_BYTES)
        if order is None or heads is None:
            return None
        o = np.frombuffer(order, dtype=_ORDER_ROW)
        h = np.frombuffer(heads, dtype=_HEADS_ROW)
        codec = h["codec"]
        good = (
            (h["magic"] == np.frombuffer(MAGIC, dtype="V4")[0])
            & (h["version"] == FORMAT_VERSION)
            & (codec <= CODEC_ZSTD_SHUFFLE2)
            & ((codec != CODEC_RAW) | (h["stored"] == h["raw"]))
            & ((codec != CODEC_ZSTD_SHUFFLE2) | (h["raw"] % 2 == 0))
            & (h["key"] == h["hkey"])
            & (h["hns"] == self._ns)
            & (h["raw"] == self.block_bytes)
        )
        seqs, oseq = o["seq"].astype(np.uint64), h["oseq"].astype(np.uint64)
        if len(seqs) > 1 and not bool(np.all(seqs[1:] > seqs[:-1])):
            return None
        by_age = np.argsort(oseq, kind="stable")
        if len(o) == len(h):  # one order entry per header: pair them up in seq order
            good[by_age] &= (seqs == oseq[by_age]) & (o["key"] == h["key"][by_age])
        elif len(o):  # stale order entries too (skipped, as the walk skips them)
            at = np.minimum(np.searchsorted(seqs, oseq), len(o) - 1)
            good &= (seqs[at] == oseq) & (o["key"][at] == h["key"])
        else:
            good &= False
        if not bool(good.all()):
            return None
        return h["key"][by_age[::-1][: self.capacity_blocks]].tolist()

    def _malformed(self, txn: lmdb.Transaction) -> dict[bytes, int | None]:
        """Store keys of this namespace whose entries are malformed or incomplete (a header
        without payload or order entry, a payload without header), with their order seq."""
        shared, nsb = self._shared, self._nsb
        bad: dict[bytes, int | None] = {}
        for sk, head in _under(txn.cursor(db=shared.heads), nsb, values=True):
            key, seq = sk[NS_BYTES:], head_seq(head)
            v = txn.get(sk)
            try:
                if v is None or len(key) != KEY_BYTES or seq is None:
                    raise BlockCorruptError("no payload")
                if txn.get(nsb + seq_bytes(seq), db=shared.order) != key:
                    raise BlockCorruptError("no order entry")
                self._header(key, head, len(v))
            except BlockCorruptError:
                bad[sk] = seq
        for sk in _under(txn.cursor(), nsb, values=False):
            if txn.get(sk, db=shared.heads) is None:
                bad[sk] = None
        return bad

    def _register(self, namespace: str) -> None:
        """Record this namespace's capacity and name and this tier's attach entry (see
        tiers/lmdb_attach.py): what `tiercache inspect` shows. Its own write txn, after the
        scan: the records never change a block."""
        shared = self._shared
        with shared.write_lock:
            txn = self._begin(write=True)
            try:
                self._token = lmdb_attach.register(
                    txn,
                    shared.meta,
                    nsb=self._nsb,
                    namespace=namespace,
                    capacity=self.capacity_blocks,
                )
                txn.commit()
            except lmdb.MapFullError:
                txn.abort()
                log.warning("%s: map full: this tier is not shown as attached", self._path)
            except lmdb.Error as exc:
                txn.abort()
                raise ConfigError("path", damaged(self._path, exc)) from None
            except BaseException:
                txn.abort()
                raise

    def _unregister(self) -> None:
        token, self._token = self._token, None
        if token is None:
            return
        shared = self._shared
        try:
            with shared.write_lock, shared.env.begin(write=True) as txn:
                lmdb_attach.unregister(txn, shared.meta, token)
        except lmdb.Error as exc:  # the entry stays; inspect shows it stale once we exit
            log.warning("%s: attach entry not removed at close: %s", self._path, exc)

    def flush(self) -> None:
        """Apply pending deletes; then fsync unless sync = "never"."""
        if self._closed:
            return
        if self._shared.pending:
            self._commit([], lambda i: (b"", b""))
        if self._sync != "never" and not self._shared.durable:
            self._env_sync()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._shared.pending:
                self._commit([], lambda i: (b"", b""))
        except OSError as exc:
            log.warning("%s: pending deletes not applied at close: %s", self._path, exc)
        finally:
            self._unregister()
            _detach(self._shared)  # syncs and closes the environment with its last user
        self._slot_key.clear()

    # -- helpers ---------------------------------------------------------------------------
    def _begin(self, write: bool) -> lmdb.Transaction:
        """A transaction (default db: blocks); retries what other processes cause briefly."""
        shared = self._shared
        for attempt in range(_RETRIES):
            try:
                return shared.env.begin(db=shared.blocks, write=write, buffers=not write)
            except (lmdb.ReadersFullError, lmdb.BadRslotError):
                shared.env.reader_check()  # frees the slots of readers that died
            except lmdb.MapResizedError:
                # Another process grew the map: adopt its size (LMDB wants no txn of this
                # process open meanwhile; a concurrent reader here would retry).
                shared.env.set_mapsize(0)
            except lmdb.Error as exc:
                raise self._os_error("begin", exc) from None
            time.sleep(0.001 * 2**attempt)
        raise OSError(errno.EAGAIN, f"{self._path}: LMDB busy (reader table full)")

    def _os_error(self, what: str, exc: lmdb.Error) -> OSError:
        if isinstance(exc, lmdb.MapFullError):
            size = self._shared.map_size
            return OSError(errno.ENOSPC, f"{self._path}: LMDB map full during {what} ({size} B)")
        return OSError(errno.EIO, f"{self._path}: LMDB {what} failed: {exc}")

    def __repr__(self) -> str:
        return (
            f"LMDBTier(medium={self.medium!r}, path={self._path!r}, "
            f"block_bytes={self.block_bytes}, used={self.used_blocks}/{self.capacity_blocks}, "
            f"compression={self._compression!r})"
        )


# -- offline access, for the CLI (inspect, verify, evict) -------------------------------------


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

    def counts(self) -> dict[int, int]:
        """Namespace id -> the block count the store keeps for it (what its capacity bounds)."""
        out = {}
        with self.env.begin(write=False) as txn:
            for k, v in _under(txn.cursor(db=self.meta_db), COUNT_PREFIX, values=True):
                out[int.from_bytes(k[len(COUNT_PREFIX) :], "big")] = _u64(v)
        return out


@contextlib.contextmanager
def open_store(path: str | os.PathLike[str], *, write: bool = False) -> Iterator[StoreHandle]:
    """An existing store for offline tools: opened read-only (nothing in the data file
    changes; LMDB registers its readers in lock.mdb) unless `write`. Other processes may hold
    the store open meanwhile (LMDB's reader table and writer mutex keep them consistent).
    When a tier of this process has it open, its environment is borrowed: LMDB forbids a
    second open of one environment per process. ConfigError when `path` is not a store."""
    if not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise ConfigError("path", f"expected a directory path, got {path!r}")
    real = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))
    if not os.path.isfile(os.path.join(real, "data.mdb")):
        raise ConfigError("path", f"{real} is not an LMDB store (no data.mdb)")
    with _ENVS_LOCK:
        shared = _ENVS.get(real)
        if shared is not None:
            shared.refs += 1
    if shared is not None:
        try:
            with shared.env.begin(write=False) as txn:
                meta_db = shared.env.open_db(META_DB, txn=txn, create=False)
                meta = _parse_meta(real, txn.get(META_KEY, b"", db=meta_db))
            yield StoreHandle(
                real,
                shared.env,
                shared.heads,
                shared.blocks,
                meta,
                shared.write_lock,
                shared.meta,
                shared.order,
            )
        finally:
            _detach(shared)
        return
    try:
        env = lmdb.open(
            real,
            map_size=0,  # the size recorded in the environment
            subdir=True,
            max_dbs=len(DB_NAMES),
            readonly=not write,
            writemap=write,  # as the tiers open it
            readahead=False,  # as the tiers open it: a cold probe reads its pages only
            lock=True,
            create=False,
            max_readers=MAX_READERS,
        )
    except lmdb.Error as exc:
        raise ConfigError("path", f"{real}: cannot open as an LMDB environment: {exc}") from None
    try:
        try:
            with env.begin(write=False) as txn:
                names = set(txn.cursor().iternext(values=False))
                if META_DB not in names:
                    raise ConfigError(
                        "path", f"{real}: no tiercache metadata in this LMDB environment"
                    )
                meta_db = env.open_db(META_DB, txn=txn, create=False)
                meta = _parse_meta(real, txn.get(META_KEY, b"", db=meta_db))
            if not {HEADS_DB, BLOCKS_DB, ORDER_DB} <= names:
                raise ConfigError("path", f"{real}: the heads, blocks or order database is missing")
            # Outside that txn: a handle opened in a read txn dies with it.
            dbs = [env.open_db(n, create=False) for n in DB_NAMES]
        except lmdb.Error as exc:
            raise ConfigError("path", f"{real}: unreadable LMDB environment: {exc}") from None
        yield StoreHandle(real, env, dbs[1], dbs[2], meta, threading.Lock(), dbs[0], dbs[3])
    finally:
        env.close()


def _leading_heads(
    txn: lmdb.Transaction,
    heads: Any,
    keys: Sequence[bytes],
    ns: int,
    block_bytes: int,
    stop: Collection[bytes] = (),
    order: Any = None,
    bad: Callable[[bytes, bytes], None] | None = None,
) -> int:
    """How many leading `keys` have a well-formed header of namespace `ns` in `heads` (up to
    a store key in `stop`: one being deleted) and, where `order` is given, an order entry
    naming the key at the header's seq (the seq is not covered by the checksum). `bad`
    hears of the entry (store key, head) where the run stops on one that is malformed."""
    nsb = ns.to_bytes(NS_BYTES, "big")
    n = 0
    try:
        for k in keys:
            sk = nsb + k
            if sk in stop:
                break
            head = txn.get(sk, db=heads)
            if head is None:
                break
            if not is_header_of(head, k, ns, block_bytes) or (
                order is not None and txn.get(nsb + head[HEADER_SIZE:], db=order) != k
            ):
                if bad is not None:
                    bad(sk, bytes(head))
                break
            n += 1
    except lmdb.Error:
        pass  # what was counted stands; a read verifies each block anyway
    return n


class LMDBProbe:
    """A read-only `StoreProbe` of an LMDB store (`LMDBTier.open_probe`): the environment is
    opened read-only (`open_store`; borrowed when a tier of this process has it open) when
    first asked, and again after a failure at most once a second; it never writes."""

    RETRY_S = 1.0

    def __init__(self, path: str, block_bytes: int, *, namespace: str = "") -> None:
        self._path = path
        self._block_bytes = block_bytes
        self._ns = namespace_id(namespace)
        self._stack: contextlib.ExitStack | None = None
        self._handle: StoreHandle | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def _open(self) -> StoreHandle | None:
        if self._handle is None and time.monotonic() >= self._retry_at:
            stack = contextlib.ExitStack()
            try:
                self._handle = stack.enter_context(open_store(self._path))
                self._stack = stack
            except (ConfigError, OSError) as exc:
                stack.close()
                self._retry_at = time.monotonic() + self.RETRY_S
                log.debug("LMDB probe of %s: not open yet (%s)", self._path, exc)
        return self._handle

    def probe(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            h = self._open()
            if h is None or not keys:
                return 0
            try:
                txn = h.env.begin(write=False)
            except lmdb.MapResizedError:
                # A writer grew the map since we opened: adopt its size and go on.
                h.env.set_mapsize(0)
                txn = h.env.begin(write=False)
            except lmdb.Error as exc:
                log.debug("LMDB probe of %s: %s", self._path, exc)
                return 0
            try:
                return _leading_heads(
                    txn, h.heads, keys, self._ns, self._block_bytes, order=h.order
                )
            finally:
                txn.abort()

    def close(self) -> None:
        with self._lock:
            stack, self._stack, self._handle = self._stack, None, None
            self._retry_at = float("inf")
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
                    store = _StoreTxn(txn, h.meta_db, h.heads, h.blocks, h.order)
                    for k in todo[a : a + MIN_TXN_OPS]:
                        had = any(txn.get(k, db=d) is not None for d in (h.heads, h.blocks))
                        store.delete(k, None)
                        gone += had
                    store.finish()
            except lmdb.Error as exc:
                raise OSError(errno.EIO, f"{h.path}: LMDB delete failed: {exc}") from None
    return gone
