"""`NVMeTier`: blocks in one preallocated slab file, one O_DIRECT-aligned slot per block, and a
checksummed append-only index journal that says which key lives in which slot.

Layout under `path` (a private directory, 0700; every file 0600):
- `meta.json`: format tag and version, block_bytes, capacity_blocks, slot_bytes (JSON, never
  pickle; written to `meta.json.tmp`, fsynced, renamed).
- `slab`: `capacity_blocks * slot_bytes` bytes, preallocated (posix_fallocate), plus the slots
  of blocks it keeps for other namespaces (see Tenants). Slot i starts
  at `i * slot_bytes` and holds a `tiers.format` record: the 64-byte header (key, namespace id,
  length, write sequence, xxh3 checksum over header and payload), the raw payload, zero
  padding. `slot_bytes` = HEADER_SIZE + block_bytes rounded up to 4096, so every slot offset
  and length is O_DIRECT aligned.
- `index`: the journal. Fixed 40-byte records `(magic, version, op, slot, seq, key, xxh3)` with
  op PUT (key now lives in slot), FREE (slot emptied) or BASE (the sequence counter so far).
  On open every record is checked alone (a flipped byte loses one record, a torn tail loses
  the tail); per slot the record with the highest seq wins; each surviving PUT is checked
  against its slot's header (key, seq, length) before it is recovered. The journal is then
  rewritten compactly (BASE + live PUTs), and again on close and whenever it grows past
  `2 * capacity + COMPACT_SLACK` records.
- `index.img`: the index image, written with every compaction (tmp, fsync, renamed after the
  journal): the live and kept entries as fixed-width arrays (slot, seq, namespace, key), the
  journal bytes it covers with their xxh3, and the namespace of the tier that appends after
  it; checksummed as a whole. An open loads it and replays only the journal records appended
  after it (no slot is read: those PUTs are the writer's, and a read verifies key, namespace,
  seq and checksum). A missing, damaged or stale image, or a journal whose covered bytes
  changed, falls back to the full replay with header checks above (logged). An open after a
  clean close by the same namespace rewrites nothing.

In memory the index is two columns per slot (`_seqs`, uint64, 0 for a slot holding none of
this tier's blocks, and `_keys`, 16 bytes), no Python object per block; opens, replays and
compactions work on them as arrays (`_Entries`).

Crash ordering: a store writes the data of all its slots, then (fsync="always") fdatasyncs the
slab, and only then appends its PUT records (and fdatasyncs the journal). A crash before the
records land leaves slots the index does not name; a record whose data never landed, or was
torn, names a slot whose header does not match (dropped at open) or whose payload fails the
checksum (a failed position on read). No path serves bytes under a key they were not written
for.

fsync modes: "always" = durable when `write` returns; "batch" = slab then journal are
fdatasynced at `flush()`/`close()`, after every BATCH_SYNC_BLOCKS blocks written, and at most
BATCH_SYNC_SECONDS after an unsynced write (a timer); "never" = no fsync at all, not even at
`flush()` (the OS writes back when it likes; a power loss may lose the whole index).

Instances. One process per directory (an exclusive flock, taken at open; the index lives in
that process's memory). Several engines on one host given one config (replicas, vLLM
data-parallel ranks) each need a directory of their own: with `instances = N` a tier whose
`path` is held by another live process takes the first free of `path/instance1` ..
`path/instance{N-1}` (instance 0 is `path` itself, so the default layout is unchanged and
switching the option on keeps the blocks there); with `instance = k` it opens instance k and
nothing else (a data-parallel rank; `connectors.common.per_dp_rank_config` sets it), and
with `instance_env = "VAR"` the instance named by that environment variable (unset: as
without it). A restarted replica takes a free instance back, with its blocks. Locks die
with their process, so an instance held by a killed process is free again at once.

Tenants. Processes with different namespaces may use one directory one after the other
(flock: never at once). Opening deletes nothing: blocks stamped with another namespace, and
blocks of ours beyond `capacity` (the oldest, when reopened smaller), are *kept*: not served
(a read checks the header's namespace as well as its key), not counted in `used_blocks`,
never handed out as free slots, never evicted, and carried over by every journal rewrite.
This tier's `capacity` slots are the other ones; the slab holds both, so it grows past
`capacity * slot_bytes` while it keeps blocks (reserved at open like any slot). Equal keys
of two namespaces live in two slots. Dropping another namespace's blocks is an operator's
decision (`tiercache evict/clear --namespace`). The slab shrinks only by slots that hold
nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import re
import stat
import struct
import threading
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import xxhash

from tiercache.errors import BlockCorruptError, ConfigError
from tiercache.tiers.base import KEY_BYTES, Tier, check_blocks, slot_stack
from tiercache.tiers.dormant import DormantIndex
from tiercache.tiers.format import (
    CODEC_RAW,
    HEADER_SIZE,
    decode_header,
    decode_payload,
    encode_block,
    namespace_id,
)

log = logging.getLogger(__name__)

FSYNC_MODES = ("never", "batch", "always")
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers (the common logical block)
BATCH_SYNC_BLOCKS = 256  # fsync="batch": sync after this many blocks written since the last one
BATCH_SYNC_SECONDS = 1.0  # ... and at most this long after the first unsynced write
COMPACT_SLACK = 1024  # journal records allowed beyond 2 * capacity before a rewrite

_META, _SLAB, _INDEX, _IMAGE = "meta.json", "slab", "index", "index.img"
_OURS = {_META, _META + ".tmp", _SLAB, _INDEX, _INDEX + ".tmp", _IMAGE, _IMAGE + ".tmp"}
_STORE_FORMAT, _STORE_VERSION = "tiercache-nvme", 1
MAX_INSTANCES = 256  # `instances` and `instance` bound: directories tried at open
_INSTANCE_DIR = re.compile(r"instance[1-9][0-9]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_OP_PUT, _OP_FREE, _OP_BASE = 1, 2, 3
_REC_MAGIC, _REC_VERSION = b"TJ", 1
_REC = struct.Struct("<2sBBIQ16s")  # magic, version, op, slot, seq, key
_REC_SUM = struct.Struct("<Q")  # xxh3_64 of the 32 bytes above
REC_SIZE = _REC.size + _REC_SUM.size  # 40
_NO_KEY = bytes(KEY_BYTES)


def _record(op: int, slot: int, seq: int, key: bytes) -> bytes:
    body = _REC.pack(_REC_MAGIC, _REC_VERSION, op, slot, seq, key)
    return body + _REC_SUM.pack(xxhash.xxh3_64_intdigest(body))


def _parse_record(buf: bytes, off: int) -> tuple[int, int, int, bytes] | None:
    """(op, slot, seq, key) of the record at `off`, or None when it is damaged."""
    body = buf[off : off + _REC.size]
    (digest,) = _REC_SUM.unpack_from(buf, off + _REC.size)
    if xxhash.xxh3_64_intdigest(body) != digest:
        return None
    magic, version, op, slot, seq, key = _REC.unpack(body)
    if magic != _REC_MAGIC or version != _REC_VERSION or op not in (_OP_PUT, _OP_FREE, _OP_BASE):
        return None
    return op, slot, seq, key


# The index image: what an open would learn from the journal and every slot header, as
# fixed-width arrays. Header: magic, version, flags (bit 0: the writer's namespace is set;
# bit 1: one entry per namespace and key, written so by a compaction that checked it),
# journal bytes covered, xxh3_64 of those bytes, top seq, writer namespace id, slots in the
# slab, entries, namespaces; then the namespace table (u64 each), then per entry (oldest
# first) slot u32, seq u64, namespace number u32, key 16 bytes; then xxh3_64 of all before.
_IMG_MAGIC, _IMG_VERSION = b"TIMG", 1
_IMG_HEAD = struct.Struct("<4sHHQQQQQII")
_IMG_WRITER, _IMG_DISTINCT = 1, 2


@dataclass(frozen=True, slots=True)
class _Image:
    covered: int  # journal bytes it covers (a record boundary)
    journal_hash: int  # xxh3_64 of those bytes
    top_seq: int
    writer: int | None  # namespace id of the tier that appends after `covered`
    slots: np.ndarray  # u32
    seqs: np.ndarray  # u64
    ns: np.ndarray  # u64 namespace id per entry
    keys: np.ndarray  # V16
    distinct: bool  # one entry per (namespace, key): an open need not look for copies


@dataclass(frozen=True, slots=True)
class _Entries:
    """Index entries as parallel fixed-width arrays (one row per block): what the image
    holds, what an open settles and what a compaction writes; no Python object per block."""

    slots: np.ndarray  # int64
    keys: np.ndarray  # V16
    seqs: np.ndarray  # uint64
    ns: np.ndarray  # uint64 namespace id

    @classmethod
    def of(cls, items: Sequence[tuple[int, bytes, int, int]]) -> _Entries:
        """From (slot, key, seq, namespace id) tuples (the slow paths: a full replay)."""
        n = len(items)
        return cls(
            np.fromiter((e[0] for e in items), dtype=np.int64, count=n),
            np.frombuffer(b"".join(e[1] for e in items), dtype=_KEY).copy(),
            np.fromiter((e[2] for e in items), dtype=np.uint64, count=n),
            np.fromiter((e[3] for e in items), dtype=np.uint64, count=n),
        )

    def take(self, idx: np.ndarray) -> _Entries:
        return _Entries(self.slots[idx], self.keys[idx], self.seqs[idx], self.ns[idx])

    def __len__(self) -> int:
        return len(self.slots)


_KEY = np.dtype(f"V{KEY_BYTES}")
# A journal record's first 32 bytes as a numpy row (the layout of _REC, little-endian).
_REC_ROW = np.dtype(
    [
        ("magic", "S2"),
        ("version", "u1"),
        ("op", "u1"),
        ("slot", "<u4"),
        ("seq", "<u8"),
        ("key", _KEY),
    ]
)
assert _REC_ROW.itemsize == _REC.size


def _put_records(e: _Entries) -> bytes:
    """PUT records of `e`, in its order: the bodies built as one array, only the per-record
    xxh3 in a Python loop (about 0.2 us each)."""
    n = len(e)
    rows = np.zeros(n, dtype=_REC_ROW)
    rows["magic"], rows["version"], rows["op"] = _REC_MAGIC, _REC_VERSION, _OP_PUT
    rows["slot"], rows["seq"], rows["key"] = e.slots, e.seqs, e.keys
    body = rows.tobytes()
    view = memoryview(body)
    digest = xxhash.xxh3_64_intdigest
    sums = np.fromiter(
        (digest(view[i : i + _REC.size]) for i in range(0, len(body), _REC.size)),
        dtype="<u8",
        count=n,
    )
    out = np.empty((n, REC_SIZE), dtype=np.uint8)
    out[:, : _REC.size] = rows.view(np.uint8).reshape(n, _REC.size)
    out[:, _REC.size :] = sums.view(np.uint8).reshape(n, _REC_SUM.size)
    return out.tobytes()


def encode_image(
    journal: bytes,
    top_seq: int,
    writer: int | None,
    nslots: int,
    entries: _Entries,
    *,
    distinct: bool = False,
) -> bytes:
    """The image of `entries` (oldest first) covering all of `journal`; `distinct`: the
    caller checked that they hold one entry per namespace and key."""
    n = len(entries)
    table, number = np.unique(entries.ns, return_inverse=True)
    head = _IMG_HEAD.pack(
        _IMG_MAGIC,
        _IMG_VERSION,
        (_IMG_WRITER if writer is not None else 0) | (_IMG_DISTINCT if distinct else 0),
        len(journal),
        xxhash.xxh3_64_intdigest(journal),
        top_seq,
        writer or 0,
        nslots,
        n,
        len(table),
    )
    body = b"".join(
        [
            head,
            table.astype("<u8").tobytes(),
            entries.slots.astype("<u4").tobytes(),
            entries.seqs.astype("<u8").tobytes(),
            number.astype("<u4").tobytes(),
            entries.keys.tobytes(),
        ]
    )
    return body + _REC_SUM.pack(xxhash.xxh3_64_intdigest(body))


_REC_FULL = np.dtype([("body", _REC_ROW), ("sum", "<u8")])
assert _REC_FULL.itemsize == REC_SIZE


def _tail_records(tail: bytes | memoryview) -> tuple[_Entries, int, int]:
    """The newest well-formed PUT or FREE record per slot of a journal tail, as arrays
    (`ns` holds each record's op), how many records were damaged (a torn end counts one)
    and the highest seq of any well-formed record. Every record's checksum is verified
    (one xxh3 call each, the rest as arrays); of equal seqs for one slot the first record
    wins, as in `replay_journal`."""
    n = len(tail) // REC_SIZE
    damaged = int(len(tail) % REC_SIZE != 0)
    recs = np.frombuffer(tail, dtype=_REC_FULL, count=n)
    view = memoryview(tail)
    digest = xxhash.xxh3_64_intdigest
    sums = np.fromiter(
        (digest(view[o : o + _REC.size]) for o in range(0, n * REC_SIZE, REC_SIZE)),
        dtype=np.uint64,
        count=n,
    )
    body = recs["body"]
    ok = (
        (sums == recs["sum"])
        & (body["magic"] == _REC_MAGIC)
        & (body["version"] == _REC_VERSION)
        & np.isin(body["op"], (_OP_PUT, _OP_FREE, _OP_BASE))
    )
    damaged += n - int(ok.sum())
    good = np.flatnonzero(ok & (body["op"] != _OP_BASE))
    top = body["seq"][ok]
    slot, seq = body["slot"][good].astype(np.int64), body["seq"][good]
    # By slot, then seq, then position backwards: each slot's last row is its winner.
    order = np.lexsort((-good, seq, slot))
    last = np.ones(len(order), dtype=bool)
    last[:-1] = slot[order][1:] != slot[order][:-1]
    win = good[order[last]]
    t = _Entries(
        body["slot"][win].astype(np.int64),
        body["key"][win],
        body["seq"][win].astype(np.uint64),
        body["op"][win].astype(np.uint64),
    )
    return t, damaged, int(top.max(initial=0))


def _newest(e: _Entries) -> np.ndarray:
    """Which entries to keep: per (namespace, key) the one of highest seq (the first of
    equal seqs). Keys are hashes, so a 64-bit mix of key and namespace finds candidates with
    one sort; only those (normally none) are compared whole, in Python."""
    n = len(e)
    keep = np.ones(n, dtype=bool)
    if n < 2:
        return keep
    k = e.keys.view("<u8").reshape(n, 2)
    h = k[:, 0] ^ (k[:, 1] * np.uint64(0x9E3779B97F4A7C15)) ^ e.ns
    order = np.argsort(h, kind="stable")
    hs = h[order]
    dup = np.flatnonzero(hs[1:] == hs[:-1])
    if not dup.size:
        return keep
    best: dict[tuple[int, bytes], int] = {}
    for i in np.unique(np.concatenate([order[dup], order[dup + 1]])).tolist():
        ident = (int(e.ns[i]), e.keys[i].tobytes())
        j = best.get(ident)
        if j is None:
            best[ident] = i
        elif int(e.seqs[i]) > int(e.seqs[j]):
            keep[j] = False
            best[ident] = i
        else:
            keep[i] = False
    return keep


def decode_image(data: bytes) -> _Image | None:
    """The image in `data`, or None when it is damaged, foreign or of another version."""
    if len(data) < _IMG_HEAD.size + _REC_SUM.size:
        return None
    body = memoryview(data)[: -_REC_SUM.size]
    (digest,) = _REC_SUM.unpack_from(data, len(body))
    if xxhash.xxh3_64_intdigest(body) != digest:
        return None
    magic, version, flags, covered, jhash, top, writer, _nslots, n, nt = _IMG_HEAD.unpack_from(data)
    if magic != _IMG_MAGIC or version != _IMG_VERSION or covered % REC_SIZE:
        return None
    off = _IMG_HEAD.size
    if len(body) != off + 8 * nt + (4 + 8 + 4 + KEY_BYTES) * n:
        return None
    table = np.frombuffer(data, dtype="<u8", count=nt, offset=off)
    off += 8 * nt
    slots = np.frombuffer(data, dtype="<u4", count=n, offset=off)
    seqs = np.frombuffer(data, dtype="<u8", count=n, offset=off + 4 * n)
    number = np.frombuffer(data, dtype="<u4", count=n, offset=off + 12 * n)
    if n and int(number.max()) >= nt:
        return None
    keys = np.frombuffer(data, dtype=_KEY, count=n, offset=off + 16 * n)
    return _Image(
        covered,
        jhash,
        top,
        writer if flags & _IMG_WRITER else None,
        slots,
        seqs,
        table[number] if n else np.zeros(0, dtype="<u8"),
        keys,
        bool(flags & _IMG_DISTINCT),
    )


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        view, offset = view[n:], offset + n


class _Buffer:
    """A page-aligned slot-sized buffer (anonymous mmap) with memoryview and numpy views."""

    __slots__ = ("arr", "mm", "view")

    def __init__(self, size: int) -> None:
        self.mm = mmap.mmap(-1, size)
        self.view = memoryview(self.mm)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)


class NVMeTier(Tier):
    """Blocks in a preallocated slab file with a persisted, checksummed index."""

    kind: ClassVar[str] = "nvme"
    persistent: ClassVar[bool] = True
    shared: ClassVar[bool] = False
    OPTIONS: ClassVar = {
        "path": str,
        "fsync": str,
        "io_threads": int,
        "direct": bool,
        "instances": int,
        "instance": int,
        "instance_env": str,
    }

    def __init__(
        self,
        *,
        name: str = "nvme",
        block_bytes: int,
        capacity_blocks: int,
        path: str | os.PathLike[str],
        fsync: str = "batch",
        namespace: str | None = "",
        io_threads: int = 4,
        direct: bool = True,
        instances: int = 1,
        instance: int | None = None,
    ) -> None:
        super().__init__(name=name, block_bytes=block_bytes, capacity_blocks=capacity_blocks)
        _check_fsync(fsync, "fsync")
        _check_io_threads(io_threads, "io_threads")
        check_instances(instances, instance)
        if not isinstance(path, str | os.PathLike) or not os.fspath(path):
            raise ConfigError("path", f"expected a directory path, got {path!r}")
        self._base = os.path.abspath(os.fspath(path))  # the configured path: instance 0
        self._path = self._base  # the directory this tier holds, set by _take_instance
        self._instances, self._instance = instances, instance
        self.instance = 0  # which instance this tier opened
        self._fsync = fsync
        # None: an offline tool's view (the CLI), where every namespace's blocks are indexed.
        self._ns = None if namespace is None else namespace_id(namespace)
        # slot -> (key, seq, namespace id) of blocks kept, not ours
        self._kept: dict[int, tuple[bytes, int, int]] = {}
        self._ns_of: dict[int, int] = {}  # slot -> namespace id, only when namespace is None
        self._nslots = capacity_blocks  # slots in the slab: ours (capacity) + kept
        self._slot_bytes = -(-(HEADER_SIZE + block_bytes) // ALIGN) * ALIGN
        self._lock = threading.Lock()  # guards the journal, the index map and the counter
        # The index of this tier's live blocks, per slot (fixed width, no object per block):
        # the write seq (0: the slot holds none of ours) and the key.
        self._seqs = np.zeros(0, dtype=np.uint64)
        self._keys = np.zeros(0, dtype=_KEY)
        self._live = 0  # slots with a nonzero seq
        self._seq = 0
        self._unsynced = 0
        self._timer: threading.Timer | None = None
        self._spare: list[_Buffer] = []  # aligned slot buffers kept between calls
        self._spare_lock = threading.Lock()
        self._io_threads = io_threads
        self._dirfd = self._fd = self._jfd = -1
        self._jlen = 0
        self._pool: ThreadPoolExecutor | None = None
        self.direct = False
        self.open_report: dict[str, int] = {}
        try:
            self._open(direct, io_threads)
        except BaseException:
            self._release()
            raise

    @classmethod
    def from_config(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> NVMeTier:
        o = cfg.options
        if "path" not in o:
            raise ConfigError(f"{cfg.field}.path", "an 'nvme' tier needs a directory path")
        try:
            return cls(
                name=cfg.name,
                block_bytes=block_bytes,
                capacity_blocks=cfg.capacity_in_blocks(block_bytes),
                path=o["path"],
                fsync=o.get("fsync", "batch"),
                namespace=namespace,
                io_threads=o.get("io_threads", 4),
                direct=o.get("direct", True),
                instances=o.get("instances", 1),
                instance=o.get("instance", instance_from_env(o.get("instance_env"))),
            )
        except ConfigError as exc:
            fields = ("path", "fsync", "io_threads", "capacity", "block_bytes", "instances")
            if exc.field in (*fields, "instance", "instance_env"):
                raise ConfigError(f"{cfg.field}.{exc.field}", exc.problem) from None
            raise

    @classmethod
    def validate_options(cls, options: Mapping[str, Any], where: str) -> None:
        super().validate_options(options, where)
        if not options.get("path"):
            raise ConfigError(f"{where}.path", "an 'nvme' tier needs a directory path")
        if "fsync" in options:
            _check_fsync(options["fsync"], f"{where}.fsync")
        if "io_threads" in options:
            _check_io_threads(options["io_threads"], f"{where}.io_threads")
        check_instances(options.get("instances", 1), options.get("instance"), where)
        if "instance_env" in options:
            if "instance" in options:
                raise ConfigError(
                    f"{where}.instance_env", "give 'instance' or 'instance_env', not both"
                )
            instance_from_env(options["instance_env"], where)

    @property
    def path(self) -> str:
        return self._path

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    # -- open ------------------------------------------------------------------------------
    def _take_instance(self) -> None:
        """Lock the store directory (one process per store: the index lives in this
        process's memory): `instance` when given, else the first free of `instances`; sets
        `_path`, `_dirfd` and `instance`. ConfigError when none is free."""
        wanted = [self._instance] if self._instance is not None else range(self._instances)
        for k in wanted:
            path = instance_path(self._base, k)
            if k:
                _prepare_dir(self._base)  # it holds the instance directories
            _prepare_dir(path)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._path, self._dirfd, self.instance = path, fd, k
            return
        held = "(another process or an unclosed tier)"
        if self._instance is None and self._instances > 1:
            raise ConfigError(
                "path",
                f"{self._base!r}: all {self._instances} instances are in use by other NVMe "
                f"tiers {held}; raise 'instances' or stop one",
            )
        where = instance_path(self._base, wanted[0])
        which = f" (instance {self._instance})" if self._instance else ""
        raise ConfigError("path", f"{where!r}{which} is in use by another NVMe tier {held}")

    def _open(self, direct: bool, io_threads: int) -> None:
        self._take_instance()
        meta = self._load_meta()
        if meta is None:
            # meta.json first: from here on the directory is recognisably ours.
            self._write_meta()
        self._fd, self.direct = self._open_slab(direct)
        self._resize_slab(grow_only=True)
        if self.direct and not self._probe_direct():
            os.close(self._fd)
            self._fd, self.direct = self._open_slab(False)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix=f"tiercache-{self.medium}")
        # An existing store without its journal has lost every index entry: say so.
        index_missing = meta is not None and not os.path.exists(os.path.join(self._path, _INDEX))
        self._jfd = self._open_file(_INDEX, os.O_RDWR)
        with self._lock:
            size = os.fstat(self._jfd).st_size
            journal = os.pread(self._jfd, size, 0) if size else b""
            current = self._load_image(journal)
            if current is None:
                self._load_index(journal)
            if current:  # the image covers the whole journal and names us as its writer
                self._jlen = len(journal)
            else:
                self._compact()
        if index_missing:
            self.open_report["index_missing"] = 1
            log.warning("%s: the index journal is missing; its blocks are forgotten", self._path)
        self._resize_slab(grow_only=False)  # only slots past every held block are cut off
        if self._ns is not None and self._live:
            # The recovered blocks stay dormant: the manager takes each over when a lookup
            # or a store reaches its key, or when it needs its slot (tiers/dormant.py).
            with self._lock:
                self._dormant = DormantIndex(self._keys, self._live_slots())
        if (
            meta is not None
            and meta.get("capacity_blocks") != self.capacity_blocks
            and self._ns is not None
        ):
            self._write_meta()

    def _open_file(self, name: str, flags: int) -> int:
        p = os.path.join(self._path, name)
        try:
            fd = os.open(p, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ConfigError("path", f"{p!r} is a symlink; refusing to follow it") from None
            raise
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_uid != os.geteuid():
            problem = f"is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
        if problem:
            os.close(fd)
            raise ConfigError("path", f"{p!r} {problem}")
        if stat.S_IMODE(st.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
        return fd

    def _load_meta(self) -> dict[str, Any] | None:
        meta = _read_meta_file(self._path)
        if meta is None:
            return None
        if meta.get("block_bytes") != self.block_bytes:
            raise ConfigError(
                "block_bytes",
                f"the store at {self._path!r} holds blocks of "
                f"{meta.get('block_bytes')!r} bytes, not "
                f"{self.block_bytes}; use another path",
            )
        if meta.get("slot_bytes") != self._slot_bytes or meta.get("header_bytes") != HEADER_SIZE:
            raise ConfigError(
                "path",
                f"{os.path.join(self._path, _META)!r}: slot layout "
                f"{meta.get('slot_bytes')!r} bytes "
                f"differs from this build's {self._slot_bytes}",
            )
        return meta

    def _write_meta(self) -> None:
        meta = {
            "format": _STORE_FORMAT,
            "version": _STORE_VERSION,
            "block_bytes": self.block_bytes,
            "capacity_blocks": self.capacity_blocks,
            "slot_bytes": self._slot_bytes,
            "header_bytes": HEADER_SIZE,
        }
        fd = self._open_file(_META + ".tmp", os.O_WRONLY | os.O_TRUNC)
        try:
            _write_all(fd, json.dumps(meta, indent=1).encode() + b"\n", 0)
            self._sync(fd)  # the new content is durable before the rename publishes it
        finally:
            os.close(fd)
        os.replace(os.path.join(self._path, _META + ".tmp"), os.path.join(self._path, _META))
        self._sync(self._dirfd)

    def _open_slab(self, direct: bool) -> tuple[int, bool]:
        if direct and hasattr(os, "O_DIRECT"):
            try:
                return self._open_file(_SLAB, os.O_RDWR | os.O_DIRECT), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._warn_buffered(exc)
        return self._open_file(_SLAB, os.O_RDWR), False

    def _probe_direct(self) -> bool:
        """Some filesystems accept O_DIRECT at open and refuse it per I/O: try one read."""
        buf = _Buffer(ALIGN)
        try:
            os.preadv(self._fd, [buf.mm], 0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._warn_buffered(exc)
            return False
        return True

    def _warn_buffered(self, exc: OSError) -> None:
        warnings.warn(
            f"{self._path}: the filesystem refuses O_DIRECT ({exc.strerror}); the "
            f"{self.medium!r} tier uses buffered I/O (reads may come from the page "
            "cache)",
            RuntimeWarning,
            stacklevel=5,
        )

    def _resize_slab(self, *, grow_only: bool) -> None:
        target = max(self.capacity_blocks, self._nslots) * self._slot_bytes
        size = os.fstat(self._fd).st_size
        if size < target:
            try:  # reserve the space now: a full disk shows at open, not halfway through a store
                os.posix_fallocate(self._fd, size, target - size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise ConfigError(
                        "capacity",
                        f"{self._path!r} has no room for "
                        f"{self.capacity_blocks} slots of "
                        f"{self._slot_bytes} bytes",
                    ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                os.ftruncate(self._fd, target)
        elif size > target and not grow_only:
            os.ftruncate(self._fd, target)

    def _load_image(self, journal: bytes) -> bool | None:
        """Load the index from the image plus the journal records appended after it, reading
        no slot (lock held). None when the image is missing, damaged, or does not cover this
        journal (then the caller reads every header); True when it covers all of it and this
        tier wrote it (the journal is kept as is), False when a compaction should follow.

        The tail needs no header check: its PUTs were written by the image's writer (every
        open and every compaction writes a fresh image), and a read verifies key, namespace
        and checksum, so an entry whose data never landed is a miss there, never bytes."""
        try:
            with open(os.path.join(self._path, _IMAGE), "rb", opener=_nofollow) as f:
                img = decode_image(f.read())
        except FileNotFoundError:
            if journal:
                log.warning("%s: no index image; reading every slot header", self._path)
            return None
        except OSError as exc:
            log.warning("%s: the index image is unreadable (%s)", self._path, exc)
            return None
        if img is None:
            log.warning("%s: the index image is damaged; reading every slot header", self._path)
            return None
        if img.covered > len(journal) or (
            xxhash.xxh3_64_intdigest(memoryview(journal)[: img.covered]) != img.journal_hash
        ):
            log.warning(
                "%s: the index image does not match the journal (stale, or the journal was "
                "damaged); reading every slot header",
                self._path,
            )
            return None
        tail = memoryview(journal)[img.covered :]
        t, damaged, tail_top = _tail_records(tail)
        top = max(img.top_seq, tail_top)
        puts = t.ns == _OP_PUT  # `ns` holds each record's op here
        if img.writer is None and bool(puts.any()):
            log.warning("%s: the index image names no writer; reading every header", self._path)
            return None
        writer = np.uint64(img.writer or 0)
        cap = os.fstat(self._fd).st_size // self._slot_bytes
        slots = img.slots.astype(np.int64)
        seqs, ns, keys = img.seqs.copy(), img.ns.copy(), img.keys.copy()
        # One entry per slot, the image's last (as a slot map would keep it); entries past
        # the slab's end go to `extra` (dropped below, after the tail had its say).
        alive = slots < cap
        inside = np.flatnonzero(alive)
        pos = np.full(cap, -1, dtype=np.int64)
        pos[slots[inside]] = inside  # a repeated slot: the last assignment stays
        alive[inside] = pos[slots[inside]] == inside
        extra: dict[int, tuple[bytes, int, int]] = {}
        for i in np.flatnonzero(slots >= cap).tolist():
            extra[int(slots[i])] = (keys[i].tobytes(), int(seqs[i]), int(ns[i]))
        # The tail's newest record per slot decides, where it is newer than the image's.
        near = t.slots < cap
        at = np.where(near, pos[np.minimum(t.slots, max(cap - 1, 0))] if cap else -1, -1)
        has = at >= 0
        held = np.zeros(len(t), dtype=np.uint64)
        held[has] = seqs[at[has]]
        newer = ~has | (held < t.seqs)
        over = near & has & newer
        put_over = np.flatnonzero(over & puts)
        keys[at[put_over]], seqs[at[put_over]] = t.keys[put_over], t.seqs[put_over]
        ns[at[put_over]] = writer
        alive[at[np.flatnonzero(over & ~puts)]] = False
        add = t.take(np.flatnonzero(near & ~has & puts))
        add = _Entries(add.slots, add.keys, add.seqs, np.full(len(add), writer, dtype=np.uint64))
        for j in np.flatnonzero(~near).tolist():  # slots past the slab's end (normally none)
            slot, seq = int(t.slots[j]), int(t.seqs[j])
            cur = extra.get(slot)
            if cur is not None and cur[1] >= seq:
                continue
            if puts[j]:
                extra[slot] = (t.keys[j].tobytes(), seq, int(writer))
            else:
                extra.pop(slot, None)
        entries = _Entries(slots, keys, seqs, ns).take(np.flatnonzero(alive))
        if len(add):
            entries = _Entries(
                *(
                    np.concatenate([getattr(entries, f), getattr(add, f)])
                    for f in ("slots", "keys", "seqs", "ns")
                )
            )
        # Tail PUTs may name a key the image holds in another slot (a lost FREE record);
        # FREE records only remove entries.
        distinct = img.distinct and not len(put_over) and not len(add)
        self._settle(entries, skipped=damaged, dropped=len(extra), top_seq=top, distinct=distinct)
        self.open_report["index_image"] = 1
        self.open_report["headers_read"] = 0
        return not tail and img.writer == self._ns and self._ns is not None

    def _load_index(self, journal: bytes) -> None:
        """Replay the journal, then keep only entries whose slot header agrees (lock held)."""
        fd, sb = self._fd, self._slot_bytes
        entries, report = replay_journal(journal, os.fstat(fd).st_size // sb, per_key=False)
        items = [(e.slot, e.key, e.seq) for e in entries]
        ns_of = self._pipeline(
            len(items),
            lambda i, buf: os.preadv(fd, [buf.view[:ALIGN]], items[i][0] * sb),
            lambda i, buf: None,
            lambda i, buf, got: (
                None if isinstance(got, BaseException) else self._header_ns(buf, got, *items[i])
            ),
        )
        checked = [(*it, ns) for it, ns in zip(items, ns_of, strict=True) if ns is not None]
        self._settle(
            _Entries.of(checked),
            skipped=report.damaged,
            dropped=report.out_of_range + len(items) - len(checked),
            top_seq=report.top_seq,
        )
        self.open_report["index_image"] = 0
        self.open_report["headers_read"] = len(items)
        if len(items) != len(checked):
            log.warning(
                "%s: %d indexed blocks failed their header check and were dropped",
                self._path,
                len(items) - len(checked),
            )

    def _settle(
        self, e: _Entries, *, skipped: int, dropped: int, top_seq: int, distinct: bool = False
    ) -> None:
        """Index entries: ours up to the capacity, the rest kept (lock held). `skipped`:
        damaged records; `dropped`: entries already dropped; `distinct`: the entries are
        known to hold one per namespace and key. Array operations only, but for duplicate
        keys and kept blocks (normally none)."""
        # One slot per (namespace, key), the newest: a lost FREE record can leave an older
        # copy behind. Equal keys of two namespaces are two blocks.
        given = len(e)
        if not distinct:
            e = e.take(np.flatnonzero(_newest(e)))
        mine = np.ones(len(e), dtype=bool) if self._ns is None else e.ns == np.uint64(self._ns)
        ours = np.flatnonzero(mine)
        if not bool(np.all(e.seqs[ours][1:] > e.seqs[ours][:-1])):  # an image is in order
            ours = ours[np.argsort(e.seqs[ours], kind="stable")]  # oldest first
        over = max(0, len(ours) - self.capacity_blocks)
        used = e if over == 0 and len(ours) == len(e) else e.take(ours[over:])
        kept = e.take(np.concatenate([np.flatnonzero(~mine), ours[:over]]))
        self._kept = {
            s: (k, q, n)
            for s, k, q, n in zip(
                kept.slots.tolist(),
                kept.keys.tolist(),
                kept.seqs.tolist(),
                kept.ns.tolist(),
                strict=True,
            )
        }
        if self._ns is None:
            self._ns_of = dict(zip(e.slots.tolist(), e.ns.tolist(), strict=True))
        self._place(used.slots, kept.slots)
        self._seqs = np.zeros(self._nslots, dtype=np.uint64)
        self._keys = np.zeros(self._nslots, dtype=_KEY)
        self._seqs[used.slots] = used.seqs
        self._keys[used.slots] = used.keys
        self._live = len(used)
        self._seq = top_seq
        self.open_report = {
            "records_skipped": skipped,
            # bad headers, stale copies of a key, slots past the slab's end
            "blocks_dropped": dropped + given - len(e),
            "blocks_recovered": len(used),
            "blocks_over_capacity": over,
            "blocks_of_other_namespaces": len(kept) - over,
        }
        if over:
            log.warning(
                "%s: holds %d blocks of this namespace, capacity is %d: the %d oldest are "
                "kept but not used",
                self._path,
                len(ours),
                self.capacity_blocks,
                over,
            )
        if skipped:
            log.warning("%s: index journal had %d damaged records", self._path, skipped)

    def _place(self, used: np.ndarray, kept: np.ndarray) -> None:
        """This tier's free slots: the lowest ones that hold neither one of its blocks
        (`used`) nor a kept one, as many as its capacity leaves; the slab covers them and
        every held slot."""
        top = int(max(used.max(initial=-1), kept.max(initial=-1))) + 1
        need = max(0, self.capacity_blocks - len(used))
        taken = np.zeros(top + need, dtype=bool)
        taken[used] = True
        taken[kept] = True
        free = np.flatnonzero(~taken)[:need]
        self._nslots = max(int(free[-1]) + 1 if need else 0, top)
        self._free = slot_stack(free[::-1])  # popped from the end: ascending slots

    def _header_ns(self, buf: _Buffer, got: int, slot: int, key: bytes, seq: int) -> int | None:
        """The namespace id of the slot's header if it agrees with its journal entry."""
        try:
            h = decode_header(buf.view[:HEADER_SIZE]) if got >= HEADER_SIZE else None
        except BlockCorruptError:
            return None
        ok = (
            h is not None
            and h.key == key
            and h.seq == seq
            and h.codec == CODEC_RAW
            and h.raw_len == self.block_bytes
        )
        return h.namespace_id if ok and h is not None else None

    # -- bytes -----------------------------------------------------------------------------
    # The pool threads only run pread/pwrite syscalls (they release the GIL); the caller's
    # thread, which would otherwise sit waiting, fills and checks the aligned buffers, keeping
    # up to 2 * io_threads blocks in flight so the device queue stays full while it copies and
    # hashes. Measured with bench/bench_nvme.py on the 2-vCPU dev VM (2 MiB blocks, 256 MiB,
    # cold O_DIRECT, 4 threads, medians, ratio to raw pread/pwrite in the same run): this split
    # reads at 0.95-0.98x and writes at 1.0-1.04x raw; copy + checksum on the pool threads
    # (the first version) gave reads 0.73-1.13x, writes 0.88-0.98x in an A/B on a loaded VM.
    # A plain pool, not aiofiles: aiofiles runs the same blocking calls on an executor behind an
    # event loop our synchronous callers do not have; `bench_nvme.py --aiofiles` measured bare
    # aiofiles O_DIRECT reads (no checksum, no copy) at 0.59-0.80x raw here, and shared/limits
    # measured it at 3.7 vs 15.1 GB/s for a pool of os.pread (2 MiB, 4 in flight, page cache;
    # 1.6 vs 1.85 GB/s cold).
    def _pipeline(self, n: int, io: Any, before: Any, after: Any) -> list[Any]:
        """For i in 0..n-1: `before(i, buf)` (caller), `io(i, buf)` (pool), `after(i, buf,
        result_or_exception)` (caller, in order). Returns the values of `after`."""
        pool = self._pool
        assert pool is not None
        depth = min(n, 2 * self._io_threads)
        with self._spare_lock:
            bufs = [
                self._spare.pop() if self._spare else _Buffer(self._slot_bytes)
                for _ in range(depth)
            ]
        out: list[Any] = [None] * n
        inflight: list[Any] = [None] * depth
        try:
            for i in range(n + depth):
                j = i - depth  # the block whose buffer block i reuses
                if j >= 0:
                    exc = inflight[j % depth].exception()
                    res = exc if exc is not None else inflight[j % depth].result()
                    out[j] = after(j, bufs[j % depth], res)
                if i < n:
                    buf = bufs[i % depth]
                    before(i, buf)
                    inflight[i % depth] = pool.submit(io, i, buf)
        finally:
            for f in inflight:  # on an exception, no syscall may still use a buffer we reuse
                if f is not None:
                    f.exception()
            with self._spare_lock:
                self._spare.extend(bufs)
        return out

    def write(
        self, slots: Sequence[int], src: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> None:
        n = len(slots)
        check_blocks(src, n, self.block_bytes, "src")
        keys = _check_keys(keys, n)
        self._check_slots(slots, unique=True)
        if self._ns is None:
            raise ValueError("namespace: a tier opened for every namespace (None) cannot write")
        if n == 0:
            return
        rows = (src if src.device.type == "cpu" else src.cpu()).numpy()
        with self._lock:
            first = self._seq + 1
            self._seq += n
        fd, sb, bb = self._fd, self._slot_bytes, self.block_bytes

        def fill(i: int, buf: _Buffer) -> None:
            payload = buf.arr[HEADER_SIZE : HEADER_SIZE + bb]
            payload[:] = rows[i]
            header, _ = encode_block(keys[i], payload, namespace=self._ns, seq=first + i)
            buf.view[:HEADER_SIZE] = header

        def check(i: int, buf: _Buffer, res: int | BaseException) -> BaseException | None:
            if isinstance(res, BaseException):
                return res
            return (
                None
                if res == sb
                else OSError(errno.EIO, f"short write to slot {slots[i]}: {res} of {sb} bytes")
            )

        # 1. Data: header + payload into every slot. Nothing names these slots yet.
        errors = [
            e
            for e in self._pipeline(
                n, lambda i, buf: os.pwrite(fd, buf.mm, slots[i] * sb), fill, check
            )
            if e
        ]
        for e in errors:
            if not isinstance(e, OSError):
                raise e  # a bug, not an I/O failure
        if errors:
            raise OSError(
                getattr(errors[0], "errno", errno.EIO),
                f"{self.medium}: writing {len(errors)} of {n} blocks failed: {errors[0]}",
            ) from errors[0]
        if self._fsync == "always":
            os.fdatasync(fd)  # the data is durable before any record names it
        # 2. Index: one append of n PUT records, after the data (crash ordering).
        recs = b"".join(_record(_OP_PUT, slots[i], first + i, keys[i]) for i in range(n))
        with self._lock:
            self._check_open()
            self._append(recs)
            # Indexed before the sync: if the sync fails, the manager frees these slots and
            # free() then journals them as freed.
            at = np.fromiter(slots, dtype=np.int64, count=n)
            self._live += n - int(np.count_nonzero(self._seqs[at]))
            self._seqs[at] = np.arange(first, first + n, dtype=np.uint64)
            self._keys[at] = np.frombuffer(b"".join(keys), dtype=_KEY)
            if self._fsync == "always":
                os.fdatasync(self._jfd)
            self._after_append(n)

    def read(
        self, slots: Sequence[int], dst: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> list[int]:
        n = len(slots)
        check_blocks(dst, n, self.block_bytes, "dst")
        keys = _check_keys(keys, n)
        self._check_slots(slots, unique=False)
        if n == 0:
            return []
        host = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=torch.uint8)
        rows = host.numpy()
        fd, sb, seqs, index_keys = self._fd, self._slot_bytes, self._seqs, self._keys

        def decode(i: int, buf: _Buffer, got: int | BaseException) -> BaseException | None:
            """Check and decode slot i into its row; the error instead of raising it."""
            if isinstance(got, BaseException):
                return got
            if got < HEADER_SIZE + self.block_bytes:
                return OSError(errno.EIO, f"short read ({got} bytes)")
            try:
                h = decode_header(buf.view[:HEADER_SIZE])
                if h.key != keys[i]:
                    return BlockCorruptError(f"slot holds key {h.key.hex()}")
                if self._ns is not None and h.namespace_id != self._ns:
                    return BlockCorruptError("slot holds a block of another namespace")
                # An indexed slot serves exactly the write its entry names: an entry loaded
                # from the image is not checked against the header at open, and a failed
                # rewrite of the same key can leave another write in the slot. (A slot freed
                # since has no entry; its bytes stay readable until rewritten.)
                want = seqs.item(slots[i])
                if want and want != h.seq and index_keys[slots[i]].tobytes() == h.key:
                    return BlockCorruptError(f"slot holds write {h.seq}, indexed {want}")
                # Verifies the checksum over header + payload, then one copy into the row.
                decode_payload(h, buf.view[HEADER_SIZE : HEADER_SIZE + h.stored_len], rows[i])
            except BlockCorruptError as exc:
                return exc
            return None

        results = self._pipeline(
            n, lambda i, buf: os.preadv(fd, [buf.mm], slots[i] * sb), lambda i, buf: None, decode
        )
        for r in results:
            if r is not None and not isinstance(r, OSError | BlockCorruptError):
                raise r  # a bug, not a bad block
        failed = [i for i, r in enumerate(results) if r is not None]
        if len(failed) == n and all(isinstance(r, OSError) for r in results):
            raise OSError(
                getattr(results[0], "errno", errno.EIO),
                f"{self.medium}: no block could be read: {results[0]}",
            )
        for i in failed:
            log.warning(
                "%s: slot %d (key %s): %s", self.medium, slots[i], keys[i].hex(), results[i]
            )
        if host is not dst:
            dst.copy_(host)
        return failed

    # -- slots and index -------------------------------------------------------------------
    def free(self, slots: Sequence[int]) -> None:
        """Free slots and journal it, so they stay freed after a restart. The bytes stay: a
        demotion planned with the eviction still reads them before the next write."""
        super().free(slots)
        with self._lock:
            recs = []
            seqs = self._seqs
            for s in slots:
                if seqs.item(s):
                    seqs[s] = 0
                    self._live -= 1
                    self._seq += 1
                    recs.append(_record(_OP_FREE, s, self._seq, _NO_KEY))
            if not recs or self._closed:
                return
            try:  # no sync: a lost FREE record only lets a valid block come back
                self._append(b"".join(recs))
                self._after_append(0)
            except OSError as exc:  # free must not fail (the manager frees while planning)
                log.warning("%s: journaling %d freed slots failed: %s", self.medium, len(recs), exc)

    def recover(self) -> list[tuple[bytes, int]]:
        return list(zip(*self.recover_columns(), strict=True))

    def recover_columns(self) -> tuple[list[bytes], list[int]]:
        # The slots are not free: _place hands out only slots that hold no block.
        with self._lock:
            live = self._live_slots()
            return self._keys[live].tolist(), live.tolist()

    def _live_slots(self) -> np.ndarray:
        """The slots of this tier's live blocks, oldest first (lock held)."""
        live = np.flatnonzero(self._seqs)
        return live[np.argsort(self._seqs[live], kind="stable")]

    def _append(self, data: bytes) -> None:
        """Append records at the tracked end (lock held). A partial append is cut off again so
        the next one starts on a record boundary."""
        try:
            _write_all(self._jfd, data, self._jlen)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._jfd, self._jlen)
            raise
        self._jlen += len(data)

    def _after_append(self, blocks: int) -> None:
        """Batch syncing and journal compaction, after an append (lock held)."""
        if self._jlen // REC_SIZE > 2 * self._nslots + COMPACT_SLACK:
            self._compact()
        elif self._fsync == "batch" and blocks:
            self._unsynced += blocks
            if self._unsynced >= BATCH_SYNC_BLOCKS:
                self._sync_all()
            elif self._timer is None:
                self._timer = threading.Timer(BATCH_SYNC_SECONDS, self._timed_sync)
                self._timer.daemon = True
                self._timer.start()

    def _timed_sync(self) -> None:
        with self._lock:
            self._timer = None
            if self._closed or not self._unsynced:
                return
            try:
                self._sync_all()
            except OSError as exc:
                log.warning("%s: periodic sync failed: %s", self.medium, exc)

    def _sync(self, fd: int) -> None:
        if self._fsync != "never":
            os.fsync(fd)

    def _sync_all(self) -> None:
        """Slab first, then the journal that names its blocks (lock held)."""
        if self._fsync != "never":
            os.fdatasync(self._fd)
            os.fdatasync(self._jfd)
        self._unsynced = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _compact(self) -> None:
        """Rewrite the journal as BASE + the live and kept PUTs, oldest first (lock held)."""
        if self._fsync != "never":
            os.fdatasync(self._fd)  # the blocks are durable before a fresh index names them
        live = self._live_slots()
        if self._ns is not None:
            ns = np.full(len(live), self._ns, dtype=np.uint64)
        else:
            ns = np.fromiter((self._ns_of.get(s, 0) for s in live.tolist()), np.uint64, len(live))
        entries = _Entries(live, self._keys[live], self._seqs[live], ns)
        if self._kept:
            kept = _Entries.of([(s, k, q, n) for s, (k, q, n) in self._kept.items()])
            both = [
                np.concatenate([getattr(entries, f), getattr(kept, f)])
                for f in ("slots", "keys", "seqs", "ns")
            ]
            entries = _Entries(*both).take(np.argsort(both[2], kind="stable"))
        data = _record(_OP_BASE, 0, self._seq, _NO_KEY) + _put_records(entries)
        distinct = bool(_newest(entries).all())  # checked here, so that opens need not
        image = encode_image(data, self._seq, self._ns, self._nslots, entries, distinct=distinct)
        fd = self._open_file(_INDEX + ".tmp", os.O_RDWR | os.O_TRUNC)
        try:
            _write_all(fd, data, 0)
            self._sync(fd)  # complete and durable before the rename replaces the old journal
            # The image of the new journal, durable before either rename. A crash between
            # the two renames leaves an image that matches no journal: the next open reads
            # every header (slow, never wrong).
            fresh = self._write_image(image)
            os.replace(os.path.join(self._path, _INDEX + ".tmp"), os.path.join(self._path, _INDEX))
            if fresh:
                os.replace(
                    os.path.join(self._path, _IMAGE + ".tmp"), os.path.join(self._path, _IMAGE)
                )
        except BaseException:
            os.close(fd)
            raise
        old, self._jfd, self._jlen = self._jfd, fd, len(data)  # appends go to the new file now
        os.close(old)
        self._unsynced = 0
        self._sync(self._dirfd)  # and the rename itself survives a power loss

    def _write_image(self, image: bytes) -> bool:
        """Write `image` to the image's temporary file, durably; on failure remove the old
        image (it could name this tier as the writer of a journal it no longer covers) and
        return False (lock held)."""
        try:
            fd = self._open_file(_IMAGE + ".tmp", os.O_WRONLY | os.O_TRUNC)
            try:
                _write_all(fd, image, 0)
                self._sync(fd)
            finally:
                os.close(fd)
            return True
        except OSError as exc:
            log.warning("%s: writing the index image failed: %s", self.medium, exc)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._path, _IMAGE))
            return False

    # -- lifecycle -------------------------------------------------------------------------
    def flush(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._sync_all()

    def close(self) -> None:
        if self._closed:
            return
        try:
            with self._lock:
                self._closed = True  # under the lock: a pending batch-sync timer sees it
                try:
                    self._compact()
                except OSError as exc:
                    log.warning("%s: compacting the index at close failed: %s", self.medium, exc)
                    self._sync_all()
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for fd in (self._fd, self._jfd, self._dirfd):  # the directory fd last: it holds the lock
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._jfd = self._dirfd = -1

    def _check_open(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, f"{self.medium}: the tier is closed")

    def _check_slots(self, slots: Sequence[int], *, unique: bool) -> None:
        self._check_open()
        cap = self._nslots
        for s in slots:
            if (
                isinstance(s, bool)
                or not isinstance(s, int)
                or not 0 <= s < cap
                or (s in self._kept and self._ns is not None)
            ):
                raise ValueError(f"slots: {s!r} is not a slot of this tier")
        if unique and len(set(slots)) != len(slots):
            raise ValueError("slots: a write names the same slot twice")


def _check_keys(keys: Sequence[bytes] | None, n: int) -> Sequence[bytes]:
    if keys is None:
        raise ValueError(
            "keys: the nvme tier stores each block's key in its header; pass "
            "one 16-byte key per slot"
        )
    if len(keys) != n:
        raise ValueError(f"keys: expected {n} keys (one per slot), got {len(keys)}")
    for i, k in enumerate(keys):
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise ValueError(f"keys[{i}]: expected a {KEY_BYTES}-byte bytes key")
    return keys


def _check_fsync(value: object, field: str) -> None:
    if value not in FSYNC_MODES:
        raise ConfigError(
            field, f"expected one of {', '.join(map(repr, FSYNC_MODES))}, got {value!r}"
        )


def _check_io_threads(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise ConfigError(field, f"expected an int in 1..64, got {value!r}")


def check_instances(instances: object, instance: object, where: str = "") -> None:
    """`instances` in 1..MAX_INSTANCES, `instance` None or in 0..MAX_INSTANCES-1; ConfigError
    naming the field. (With `instance` given, `instances` is not used.)"""
    p = f"{where}." if where else ""

    def bad(v: object, top: int) -> bool:
        return isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < top

    if bad(instances, MAX_INSTANCES + 1) or instances == 0:
        raise ConfigError(
            f"{p}instances",
            f"expected how many processes may share this path at once, an int in "
            f"1..{MAX_INSTANCES}, got {instances!r}",
        )
    if instance is not None and bad(instance, MAX_INSTANCES):
        raise ConfigError(
            f"{p}instance", f"expected an int in 0..{MAX_INSTANCES - 1}, got {instance!r}"
        )


def instance_from_env(name: object, where: str = "") -> int | None:
    """The instance an `instance_env` option names: the number in environment variable
    `name` (e.g. "LOCAL_RANK"), or None when `name` is None or the variable is unset;
    ConfigError naming `instance_env` for a bad name or value."""
    if name is None:
        return None
    field = f"{where}.instance_env" if where else "instance_env"
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise ConfigError(field, f"expected an environment variable name, got {name!r}")
    raw = os.environ.get(name)
    if raw is None:
        return None
    digits = raw.strip()
    k = int(digits) if digits.isascii() and digits.isdigit() else -1
    if not 0 <= k < MAX_INSTANCES:
        raise ConfigError(
            field, f"${name} is {raw!r}, not an instance number in 0..{MAX_INSTANCES - 1}"
        )
    return k


def instance_path(path: str, k: int) -> str:
    """The directory of instance `k` of an NVMe store configured at `path`: `path` itself
    for 0, ``path/instance{k}`` above."""
    return path if k == 0 else os.path.join(path, f"instance{k}")


def instance_dirs(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """(k, directory) of the instances k >= 1 present under an NVMe store path, by k."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    found = [
        (int(n[8:]), os.path.join(os.fspath(path), n)) for n in names if _INSTANCE_DIR.fullmatch(n)
    ]
    return sorted(f for f in found if os.path.isdir(f[1]))


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


def _prepare_dir(path: str) -> None:
    """Create `path` (0700) if missing, or check that an existing one is ours and private."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ConfigError("path", f"{path!r}: the parent {parent!r} is not an existing directory")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except PermissionError:
        raise ConfigError("path", f"{path!r}: no permission to create it in {parent!r}") from None
    except OSError as exc:  # e.g. EROFS: a read-only filesystem
        raise ConfigError("path", f"{path!r}: cannot create it: {exc.strerror}") from None
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError("path", f"{path!r} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            "path", f"{path!r} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
        )
    if st.st_mode & 0o022:
        raise ConfigError(
            "path",
            f"{path!r} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}); use a private directory "
            "(chmod 700)",
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError("path", f"{path!r} is not writable by this user")
    names = {n for n in os.listdir(path) if not _INSTANCE_DIR.fullmatch(n)}
    if names and _META not in names and not names <= _OURS:
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(
            "path",
            f"{path!r} holds files of another program ({shown}) and no "
            f"{_META}; give the nvme tier an empty or new directory",
        )


# -- offline access, for the CLI (inspect, verify, evict) -------------------------------------


def _read_meta_file(path: str) -> dict[str, Any] | None:
    """The store's `meta.json` (None if absent), checked for format and version; ConfigError
    naming the problem otherwise. Shared by the tier's open and the offline reader."""
    p = os.path.join(path, _META)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # e.g. ELOOP: a symlink planted where our metadata belongs
        raise ConfigError("path", f"{p!r} cannot be opened ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            meta = json.loads(f.read(1 << 16))
    except (OSError, ValueError) as exc:
        raise ConfigError("path", f"{p!r} is unreadable or not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != _STORE_FORMAT:
        raise ConfigError("path", f"{p!r} does not describe a tiercache NVMe store")
    if meta.get("version") != _STORE_VERSION:
        raise ConfigError(
            "path",
            f"{p!r}: store format version {meta.get('version')!r}, "
            f"this build reads {_STORE_VERSION}",
        )
    return meta


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The `meta.json` of an existing NVMe store, read without writing anything; ConfigError
    naming the problem when `path` is not one this build reads."""
    root = os.path.abspath(os.fspath(path))
    meta = _read_meta_file(root)
    if meta is None:
        raise ConfigError("path", f"{root} is not an NVMe store (no {_META})")
    p = os.path.join(root, _META)
    for k in ("block_bytes", "capacity_blocks", "slot_bytes"):
        v = meta.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError("path", f"{p!r}: bad {k} {v!r}")
    if (
        meta.get("header_bytes") != HEADER_SIZE
        or meta["slot_bytes"] < HEADER_SIZE + meta["block_bytes"]
    ):
        raise ConfigError("path", f"{p!r}: slot layout differs from this build's")
    return meta


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """A block the index journal names: `key` written into `slot` at write sequence `seq`."""

    slot: int
    key: bytes
    seq: int


@dataclass(frozen=True, slots=True)
class JournalReport:
    """What a replay of the index journal found, before any slot header is read."""

    records: int  # whole records in the file
    damaged: int  # records failing their checksum or format, plus a torn tail
    out_of_range: int  # PUTs naming a slot beyond the capacity
    superseded: int  # live PUTs of a key that a newer PUT put in another slot
    top_seq: int


def replay_journal(
    data: bytes, capacity: int, *, per_key: bool = True
) -> tuple[list[JournalEntry], JournalReport]:
    """The live entries of a journal image in slots below `capacity` (per slot the highest
    seq wins; with `per_key`, one slot per key, the newest, since a lost FREE record can
    leave an older copy behind; the tier dedups per namespace and key instead, once it has
    read the headers), oldest first, with counts of what was skipped. Pure: reads no slot.
    The tier's open and the CLI share it."""
    best: dict[int, tuple[int, int, bytes]] = {}
    damaged, top = int(len(data) % REC_SIZE != 0), 0
    for off in range(0, len(data) - REC_SIZE + 1, REC_SIZE):
        rec = _parse_record(data, off)
        if rec is None:
            damaged += 1
            continue
        op, slot, seq, key = rec
        top = max(top, seq)
        if op != _OP_BASE and (slot not in best or seq > best[slot][0]):
            best[slot] = (seq, op, key)
    newest: dict[bytes, tuple[int, int]] = {}  # key -> (seq, slot)
    live: list[JournalEntry] = []
    out_of_range = superseded = 0
    for slot, (seq, op, key) in best.items():
        if op != _OP_PUT:
            continue
        if slot >= capacity:
            out_of_range += 1
        elif not per_key:
            live.append(JournalEntry(slot, key, seq))
        elif key not in newest or seq > newest[key][0]:
            superseded += key in newest
            newest[key] = (seq, slot)
        else:
            superseded += 1
    live += (JournalEntry(s, k, q) for k, (q, s) in newest.items())
    entries = sorted(live, key=lambda e: e.seq)
    return entries, JournalReport(len(data) // REC_SIZE, damaged, out_of_range, superseded, top)


class NVMeStoreReader:
    """A read-only view of an NVMe store on disk for offline tools: it takes no lock and
    writes nothing, so it works on a stopped store and beside the process holding it open.

    That process may move on after `entries` was read (a slot freed and written again): a
    caller that finds a mismatch on a store `in_use()` calls `reload()` and rechecks the
    entries that are still there.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.meta = read_meta(self.path)
        self.block_bytes: int = self.meta["block_bytes"]
        self.capacity_blocks: int = self.meta["capacity_blocks"]
        self.slot_bytes: int = self.meta["slot_bytes"]
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        self._dirfd = os.open(self.path, flags | os.O_DIRECTORY)
        self._fd = -1
        try:
            self._fd = os.open(os.path.join(self.path, _SLAB), flags)
            self.reload()
        except BaseException:
            self.close()
            raise

    def reload(self) -> None:
        """Read the journal again (its current file: a compaction replaces it)."""
        try:
            fd = os.open(
                os.path.join(self.path, _INDEX), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except FileNotFoundError:
            data = b""
        else:
            with os.fdopen(fd, "rb") as f:
                data = f.read()
        # Every slot of the slab (it holds kept blocks past the capacity); every live slot,
        # equal keys of two namespaces included.
        self.entries, self.journal = replay_journal(data, self.slots, per_key=False)

    @property
    def slots(self) -> int:
        """Slots in the slab: the capacity, or more while it keeps other blocks."""
        return max(self.capacity_blocks, self.slab_size // self.slot_bytes)

    @property
    def slab_size(self) -> int:
        return os.fstat(self._fd).st_size

    def last_modified(self) -> float:
        """Newest mtime of the slab and the journal (headers carry sequence numbers, not
        times)."""
        names = (_SLAB, _INDEX, _META)
        return max(
            os.stat(os.path.join(self.path, n)).st_mtime
            for n in names
            if os.path.exists(os.path.join(self.path, n))
        )

    def holder(self) -> int | None:
        """The pid holding the store open (a tier's exclusive flock on the directory), else
        None; -1 when held but the pid is unknown. Linux: read from /proc/locks, which takes
        no lock; elsewhere probed with a shared flock, released at once."""
        st = os.fstat(self._dirfd)
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        try:
            with open("/proc/locks", encoding="ascii", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            try:
                fcntl.flock(self._dirfd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return -1
            fcntl.flock(self._dirfd, fcntl.LOCK_UN)
            return None
        for line in lines:
            f = line.split()
            if len(f) >= 6 and f[1] == "FLOCK" and f[3] == "WRITE" and f[5] == dev:
                return int(f[4]) if f[4].isdigit() else -1
        return None

    def in_use(self) -> bool:
        """Whether a tier holds the store open."""
        return self.holder() is not None

    def read_slot(self, slot: int, nbytes: int | None = None) -> bytes:
        """The first `nbytes` (default: all) bytes of `slot`; short at the slab's end."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot: {slot} is not a slot of this store (0..{self.slots - 1})")
        return os.pread(self._fd, nbytes or self.slot_bytes, slot * self.slot_bytes)

    def close(self) -> None:
        for fd in (self._fd, self._dirfd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._dirfd = -1

    def __enter__(self) -> NVMeStoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
