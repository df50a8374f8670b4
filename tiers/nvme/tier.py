"""`NVMeTier`: the tier itself: options, the instance lock, open and close, write, read and
free, and the journal's append, sync and compaction (the store is described in
`tiercache.tiers.nvme`). Tests patch the tunables the tier reads at run time on this module.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from tiercache.errors import ConfigError
from tiercache.tiers.base import Tier, check_blocks, slot_stack
from tiercache.tiers.dormant import DormantIndex
from tiercache.tiers.format import HEADER_SIZE, namespace_id
from tiercache.tiers.nvme import recovery
from tiercache.tiers.nvme.image import encode_image
from tiercache.tiers.nvme.index_open import read_headers, read_image
from tiercache.tiers.nvme.io import (
    ALIGN,
    Slab,
    SlotPipeline,
    direct_works,
    open_slab,
    resize_slab,
    write_all,
    write_file,
)
from tiercache.tiers.nvme.journal import (
    KEY_DTYPE,
    NO_KEY,
    OP_FREE,
    OP_PUT,
    REC_SIZE,
    Entries,
    compacted,
    newest_per_key,
    pack_record,
)
from tiercache.tiers.nvme.layout import (
    IMAGE,
    INDEX,
    META,
    load_meta,
    open_file,
    store_meta,
    take_instance,
)
from tiercache.tiers.nvme.options import (
    check_fsync,
    check_instances,
    check_io_threads,
    check_keys,
    check_options,
    instance_from_env,
)
from tiercache.tiers.nvme.reader import NVMeOffline
from tiercache.tiers.nvme.slot_reads import Sink, SlotReads
from tiercache.tiers.nvme.slot_writes import write_slots
from tiercache.tiers.store_dir import warn_over_capacity

log = logging.getLogger(__package__)  # "tiercache.tiers.nvme"

# fsync="batch": sync after this many bytes of slots written since the last one (bytes, not
# blocks: head shards make blocks smaller, and counting them would sync more often per token)
BATCH_SYNC_BYTES = 256 << 20
BATCH_SYNC_SECONDS = 1.0  # ... and at most this long after the first unsynced write
COMPACT_SLACK = 1024  # journal records allowed beyond 2 * capacity before a rewrite
RUN_BYTES = 2 << 20  # most bytes of adjacent slots read or written by one syscall


class NVMeTier(Tier):
    """Blocks in a preallocated slab file with a persisted, checksummed index."""

    kind: ClassVar[str] = "nvme"
    persistent: ClassVar[bool] = True
    shared: ClassVar[bool] = False
    reads_in_place: ClassVar[bool] = True  # read_to hands over the aligned read buffers
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
        check_fsync(fsync, "fsync")
        check_io_threads(io_threads, "io_threads")
        check_instances(instances, instance)
        if not isinstance(path, str | os.PathLike) or not os.fspath(path):
            raise ConfigError("path", f"expected a directory path, got {path!r}")
        self._base = os.path.abspath(os.fspath(path))  # the configured path: instance 0
        self._path = self._base  # the directory this tier holds, set at open
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
        self._keys = np.zeros(0, dtype=KEY_DTYPE)
        self._live = 0  # slots with a nonzero seq
        # Released slots (a demotion carries their block away: `release`) -> the seq of the
        # block they still hold, indexed and journaled until `settle` or a rewrite.
        self._released: dict[int, int] = {}
        self._seq = 0
        self._unsynced = 0
        self._timer: threading.Timer | None = None
        self._dirfd = self._fd = self._jfd = -1
        self._jlen = 0
        self._io: SlotPipeline | None = None  # the I/O pool and its slot buffers
        self.direct = False
        self.open_report: dict[str, int] = {}
        try:
            self._open(direct, io_threads)
        except BaseException:
            self._release()
            raise

    @classmethod
    def from_config(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> NVMeTier:
        o = dict(cfg.options)
        if "path" not in o:
            raise ConfigError(f"{cfg.field}.path", "an 'nvme' tier needs a directory path")
        from_env = instance_from_env(o.pop("instance_env", None), cfg.field)
        o.setdefault("instance", from_env)
        fields = ("path", "fsync", "io_threads", "capacity", "block_bytes", "instances", "instance")
        return cls.from_options(cfg, block_bytes, fields, namespace=namespace, **o)

    @classmethod
    def offline_store(cls, path: str, name: str) -> NVMeOffline:
        return NVMeOffline(path, name, cls)

    @classmethod
    def validate_options(cls, options: Mapping[str, Any], where: str) -> None:
        super().validate_options(options, where)
        check_options(options, where)

    @property
    def path(self) -> str:
        return self._path

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    # -- open ------------------------------------------------------------------------------
    def _open(self, direct: bool, io_threads: int) -> None:
        self._path, self._dirfd, self.instance = take_instance(  # the store directory, locked
            self._base, self._instance, self._instances
        )
        meta = load_meta(self._path, self.block_bytes, self._slot_bytes)
        if meta is None:
            # meta.json first: from here on the directory is recognisably ours.
            self._write_meta()
        self._fd, self.direct = open_slab(self._path, direct, self.medium)
        self._resize_slab(grow_only=True)
        if self.direct and not direct_works(self._fd, self._path, self.medium):
            os.close(self._fd)
            self._fd, self.direct = open_slab(self._path, False, self.medium)
        self._io = SlotPipeline(
            io_threads,
            self._slot_bytes,
            f"tiercache-{self.medium}",
            run_slots=max(1, RUN_BYTES // self._slot_bytes),
        )
        self._slab = Slab(self._fd, self._slot_bytes, self.block_bytes, self._io)
        # An existing store without its journal has lost every index entry: say so.
        index_missing = meta is not None and not os.path.exists(os.path.join(self._path, INDEX))
        self._jfd = open_file(self._path, INDEX, os.O_RDWR)
        with self._lock:
            size = os.fstat(self._jfd).st_size
            journal = os.pread(self._jfd, size, 0) if size else b""
            if self._load_index(journal):  # the image covers the journal, names us its writer
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
        resized = meta is not None and meta.get("capacity_blocks") != self.capacity_blocks
        if resized and self._ns is not None:
            self._write_meta()

    def _write_meta(self) -> None:
        meta = store_meta(self.block_bytes, self.capacity_blocks, self._slot_bytes)
        data = json.dumps(meta, indent=1).encode() + b"\n"
        # The new content is durable before the rename publishes it.
        write_file(self._path, META + ".tmp", data, sync=self._fsync != "never")
        os.replace(os.path.join(self._path, META + ".tmp"), os.path.join(self._path, META))
        self._sync(self._dirfd)

    def _resize_slab(self, *, grow_only: bool) -> None:
        target = max(self.capacity_blocks, self._nslots) * self._slot_bytes
        cap, sb = self.capacity_blocks, self._slot_bytes
        no_room = f"{self._path!r} has no room for {cap} slots of {sb} bytes"
        resize_slab(self._fd, target, grow_only=grow_only, no_room=no_room)

    def _load_index(self, journal: bytes) -> bool:
        """Load the index (lock held) from the image plus the journal records after it
        (`index_open.read_image`); without a usable image, replay the journal and keep only
        entries whose slot header agrees (`index_open.read_headers`). True when the image
        covers all the journal and this tier wrote it (kept as is), False when a compaction
        should follow."""
        slab_slots = os.fstat(self._fd).st_size // self._slot_bytes
        found = read_image(self._path, journal, slab_slots)
        if found is not None:
            img, got = found
            headers, current = 0, not got.tail and img.writer == self._ns and self._ns is not None
        else:
            got, headers = read_headers(journal, self._path, self._slab)
            current = False
        self._settle(got)
        self.open_report["index_image"] = int(found is not None)
        self.open_report["headers_read"] = headers
        return current

    @property
    def slot_count(self) -> int:
        # Kept blocks of other namespaces hold slots too: ours may be numbered past capacity.
        return max(self.capacity_blocks, self._nslots)

    def _settle(self, got: recovery.Replayed) -> None:
        """Adopt the entries an open found: ours up to the capacity, the rest kept (lock
        held; `recovery.settle`)."""
        r = recovery.settle(
            got.entries,
            ns=self._ns,
            capacity=self.capacity_blocks,
            skipped=got.damaged,
            dropped=got.dropped,
            top_seq=got.top_seq,
            distinct=got.distinct,
        )
        self._kept = r.kept
        if r.ns_of is not None:
            self._ns_of = r.ns_of
        self._nslots = r.nslots
        self._free = slot_stack(r.free[::-1])  # popped from the end: ascending slots
        self._seqs, self._keys, self._live, self._seq = r.seqs, r.keys, r.live, r.top_seq
        self.open_report = dict(r.report)
        over = r.report["blocks_over_capacity"]
        then = "the %d oldest are kept but not used"
        warn_over_capacity(log, self._path, r.ours, self.capacity_blocks, over, then)
        if got.damaged:
            log.warning("%s: index journal had %d damaged records", self._path, got.damaged)

    # -- bytes -----------------------------------------------------------------------------
    # Syscalls on the pool, buffers filled and checked on the caller's thread: see
    # io.SlotPipeline for why; the data of a write is slot_writes.py, a read slot_reads.py.
    def write(
        self, slots: Sequence[int], src: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> None:
        n = len(slots)
        check_blocks(src, n, self.block_bytes, "src")
        keys = check_keys(keys, n)
        self._check_slots(slots, unique=True)
        if self._ns is None:
            raise ValueError("namespace: a tier opened for every namespace (None) cannot write")
        if n == 0:
            return
        rows = (src if src.device.type == "cpu" else src.cpu()).numpy()
        with self._lock:
            if self._released:
                # A released block's move has ended before its slot is written again (the
                # manager orders it), but `settle` may not have come yet: journal its FREE
                # before new bytes overwrite it, so a kill mid-write never leaves a record
                # naming a slot that holds another block.
                self._forget([s for s in slots if self._released.pop(s, None) is not None])
            first = self._seq + 1
            self._seq += n
        fd = self._fd
        # 1. Data: header + payload into every slot, one pwrite per run of adjacent slots.
        # Nothing names these slots yet.
        write_slots(
            self._slab,
            ns=self._ns,
            slots=slots,
            rows=rows,
            keys=keys,
            first_seq=first,
            medium=self.medium,
        )
        if self._fsync == "always":
            os.fdatasync(fd)  # the data is durable before any record names it
        # 2. Index: one append of n PUT records, after the data (crash ordering).
        recs = b"".join(pack_record(OP_PUT, slots[i], first + i, keys[i]) for i in range(n))
        with self._lock:
            self._check_open()
            self._append(recs)
            # Indexed before the sync: if the sync fails, the manager frees these slots and
            # free() then journals them as freed.
            at = np.fromiter(slots, dtype=np.int64, count=n)
            self._live += n - int(np.count_nonzero(self._seqs[at]))
            self._seqs[at] = np.arange(first, first + n, dtype=np.uint64)
            self._keys[at] = np.frombuffer(b"".join(keys), dtype=KEY_DTYPE)
            if self._fsync == "always":
                os.fdatasync(self._jfd)
            self._after_append(n)

    def read(
        self, slots: Sequence[int], dst: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> list[int]:
        n = len(slots)
        check_blocks(dst, n, self.block_bytes, "dst")
        reads = self._reads(slots, keys)
        if reads is None:
            return []
        host = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=torch.uint8)
        failed = reads.failed(reads.into(host.numpy()), self.medium)
        if host is not dst:
            dst.copy_(host)
        return failed

    def read_to(
        self,
        slots: Sequence[int],
        sink: Sink,
        keys: Sequence[bytes] | None = None,
        *,
        staging: torch.Tensor | None = None,
    ) -> list[int]:
        """`Tier.read_to` without the staging copy: each run's verified payloads go to `sink`
        as a strided view of the run buffer (`SlotReads.to_sink`); `staging` is not used."""
        reads = self._reads(slots, keys)
        if reads is None:
            return []
        return reads.failed(reads.to_sink(sink), self.medium)

    def _reads(self, slots: Sequence[int], keys: Sequence[bytes] | None) -> SlotReads | None:
        """A checked read of `slots` (None when there are none)."""
        keys = check_keys(keys, len(slots))
        self._check_slots(slots, unique=False)
        if not slots:
            return None
        return SlotReads(
            self._slab, ns=self._ns, seqs=self._seqs, index_keys=self._keys, slots=slots, keys=keys
        )

    # -- slots and index -------------------------------------------------------------------
    def free(self, slots: Sequence[int]) -> None:
        """Free slots and journal it, so they stay freed after a restart. The bytes stay
        until the next write."""
        super().free(slots)
        with self._lock:
            if self._released:
                for s in slots:
                    self._released.pop(s, None)
            self._forget(slots)

    def release(self, slots: Sequence[int]) -> None:
        """Return slots to the allocator, their blocks still indexed and journaled (no FREE
        record: a kill now recovers them) until `settle` or the next write of the slot."""
        super().free(slots)
        with self._lock:
            seqs = self._seqs
            for s in slots:
                q = seqs.item(s)
                if q:
                    self._released[s] = q

    def settle(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        """Forget released blocks whose moves ended (their slots not written since)."""
        with self._lock:
            if not self._released:
                return
            seqs, done = self._seqs, []
            for s in slots:
                q = self._released.get(s)
                if q is not None and seqs.item(s) == q:
                    del self._released[s]
                    done.append(s)
            self._forget(done)

    def _forget(self, slots: Sequence[int]) -> None:
        """Drop slots' blocks from the index and journal FREE records (lock held)."""
        recs = []
        seqs = self._seqs
        for s in slots:
            if seqs.item(s):
                seqs[s] = 0
                self._live -= 1
                self._seq += 1
                recs.append(pack_record(OP_FREE, s, self._seq, NO_KEY))
        if not recs or self._closed:
            return
        try:  # no sync: a lost FREE record only lets a valid block come back
            self._append(b"".join(recs))
            self._after_append(0)
        except OSError as exc:  # free must not fail (the manager frees while planning)
            log.warning("%s: journaling %d freed slots failed: %s", self.medium, len(recs), exc)

    def recover_columns(self) -> tuple[list[bytes], list[int]]:
        # The slots are not free: recovery.place hands out only slots that hold no block.
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
            write_all(self._jfd, data, self._jlen)
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
            self._unsynced += blocks * self._slot_bytes
            if self._unsynced >= BATCH_SYNC_BYTES:
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
        kept = [(s, k, q, n) for s, (k, q, n) in self._kept.items()]
        entries, data = compacted(
            Entries(live, self._keys[live], self._seqs[live], ns), kept, self._seq
        )
        distinct = bool(newest_per_key(entries).all())  # checked here, so that opens need not
        image = encode_image(data, self._seq, self._ns, self._nslots, entries, distinct=distinct)
        fd = open_file(self._path, INDEX + ".tmp", os.O_RDWR | os.O_TRUNC)
        try:
            write_all(fd, data, 0)
            self._sync(fd)  # complete and durable before the rename replaces the old journal
            # The image of the new journal, durable before either rename. A crash between
            # the two renames leaves an image that matches no journal: the next open reads
            # every header (slow, never wrong).
            fresh = self._write_image(image)
            os.replace(os.path.join(self._path, INDEX + ".tmp"), os.path.join(self._path, INDEX))
            if fresh:
                os.replace(
                    os.path.join(self._path, IMAGE + ".tmp"),
                    os.path.join(self._path, IMAGE),
                )
        except BaseException:
            os.close(fd)
            raise
        old, self._jfd, self._jlen = self._jfd, fd, len(data)  # appends go to the new file now
        os.close(old)
        self._unsynced = 0
        self._sync(self._dirfd)  # and the rename itself survives a power loss

    def _write_image(self, image: bytes) -> bool:
        """Write `image` to the image's temporary file, durably (lock held); on failure remove
        the old image (it may name a journal it no longer covers) and return False."""
        try:
            write_file(self._path, IMAGE + ".tmp", image, sync=self._fsync != "never")
            return True
        except OSError as exc:
            log.warning("%s: writing the index image failed: %s", self.medium, exc)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self._path, IMAGE))
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
        if self._io is not None:
            self._io.shutdown()
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
