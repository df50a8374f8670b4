"""Offline access to an NVMe store.

- `NVMeStoreReader`: read-only, it takes no lock and writes nothing (the CLI, the siblings of
  a path). `blocks()`: the good blocks' headers, one copy per block; `entry_problem(entry,
  scratch)`: what is wrong with an entry's block.
- `NVMeOffline`: the store as the CLI's `OfflineStore` (`NVMeTier.offline_store`): reads
  through a reader; `repair` and `drop` open the store as a tier (the owner must be gone).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from tiercache.errors import BlockCorruptError, ConfigError, StoreError
from tiercache.tiers.format import (
    CODEC_RAW,
    FORMAT_VERSION,
    HEADER_SIZE,
    BlockHeader,
    decode_payload,
    header_of,
)
from tiercache.tiers.nvme.journal import JournalEntry, newest_copies, replay_journal
from tiercache.tiers.nvme.layout import INDEX, META, SLAB, open_nofollow, read_meta
from tiercache.tiers.offline import BlockInfo, Problem, summarize

READ_BATCH_BYTES = 64 * 2**20  # rows per tier.read during a repair


class NVMeStoreReader:
    """A read-only view of an NVMe store on disk for offline tools: it takes no lock and
    writes nothing, so it works beside the process holding it open. That process may move
    on after `entries` was read: a caller that finds a mismatch on a store `in_use()` calls
    `reload()` and rechecks the entries that are still there."""

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
            self._fd = os.open(os.path.join(self.path, SLAB), flags)
            self.reload()
        except BaseException:
            self.close()
            raise

    def reload(self) -> None:
        """Read the journal again (its current file: a compaction replaces it)."""
        try:
            with open(os.path.join(self.path, INDEX), "rb", opener=open_nofollow) as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
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
        names = (SLAB, INDEX, META)
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

    def blocks(self) -> tuple[list[BlockInfo], int]:
        """Each good block the journal names (its header read, the payload not), the newest
        copy per (namespace, key) only; and how many entries fail their header check."""
        good: list[tuple[JournalEntry, BlockHeader]] = []
        bad = 0
        for e in self.entries:
            try:
                h = header_of(self.read_slot(e.slot, HEADER_SIZE), e.key, None, self.block_bytes)
            except BlockCorruptError:
                h = None
            if h is None or h.seq != e.seq:
                bad += 1
                continue
            good.append((e, h))
        newest, _ = newest_copies(good, lambda g: (g[1].namespace_id, g[1].key), lambda g: g[1].seq)
        return [
            BlockInfo(h.key, h.seq, h.namespace_id, h.raw_len, h.stored_len, e.slot)
            for e, h in newest.values()
        ], bad

    def entry_problem(self, e: JournalEntry, scratch: np.ndarray) -> str | None:
        """What is wrong with the block of entry `e` (header, seq, codec, checksum), read
        whole and decoded into `scratch`; None when it is good."""
        data = self.read_slot(e.slot)
        try:
            h = header_of(data[:HEADER_SIZE], e.key, None, self.block_bytes)
            if h.seq != e.seq:
                return f"header seq {h.seq}, the index says {e.seq} (an unfinished rewrite)"
            if h.codec != CODEC_RAW:
                return f"codec {h.codec} in an NVMe slot (NVMe stores raw blocks)"
            decode_payload(h, data[HEADER_SIZE : HEADER_SIZE + h.stored_len], scratch)
        except BlockCorruptError as exc:
            return str(exc)
        return None

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


class NVMeOffline:
    """An NVMe store as an `OfflineStore`: each read through its own `NVMeStoreReader`;
    `repair` and `drop` open the store as a `tier_class` tier of this process (its exclusive
    lock, so StoreError while another process holds it), at its own size."""

    def __init__(self, path: str, name: str, tier_class: Callable[..., Any]) -> None:
        self.path, self.name, self.tier_class = path, name, tier_class

    def exists(self) -> bool:
        return os.path.exists(os.path.join(self.path, META))

    def count(self) -> int:
        with NVMeStoreReader(self.path) as r:
            return len(r.entries)

    def blocks(self) -> list[BlockInfo]:
        with NVMeStoreReader(self.path) as r:
            return r.blocks()[0]

    def describe(self, names: Mapping[int, str]) -> dict[str, Any]:
        with NVMeStoreReader(self.path) as r:
            blocks, bad = r.blocks()
            pid = r.holder()
            return {
                "format": f"tiercache-nvme v{r.meta['version']}, block format v{FORMAT_VERSION}",
                "block_bytes": r.block_bytes,
                "capacity_blocks": r.capacity_blocks,
                "used_blocks": len(blocks),
                "file_bytes": r.slab_size,
                **summarize(blocks, names),
                "unreadable_entries": bad,
                "index_damaged_records": r.journal.damaged,
                "last_modified": r.last_modified(),
                "in_use": pid is not None,
                "holder_pid": pid if pid and pid > 0 else None,
            }

    def verify(self, advance: Callable[[int], None]) -> tuple[int, list[Problem], list[str]]:
        """The slab's size, the journal's damaged and out-of-range records, then every entry's
        block (`NVMeStoreReader.entry_problem`)."""
        problems, notes = [], []
        with NVMeStoreReader(self.path) as r:
            scratch = np.empty(r.block_bytes, dtype=np.uint8)
            want = r.capacity_blocks * r.slot_bytes  # at least: kept blocks add slots
            if r.slab_size < want:
                problems.append(
                    Problem("slab", f"holds {r.slab_size} bytes, {want} expected for its capacity")
                )
            j = r.journal
            if j.damaged:
                problems.append(Problem("index", f"{j.damaged} damaged journal records"))
            if j.out_of_range:
                problems.append(
                    Problem("index", f"{j.out_of_range} records name slots beyond the slab")
                )
            bad = []
            for e in r.entries:
                what = r.entry_problem(e, scratch)
                if what:
                    bad.append((e, what))
                advance(1)
            checked = len(r.entries)
            if bad and r.in_use():
                # The owner may have freed and rewritten a slot after we read the journal:
                # keep only entries that are still live and still fail.
                r.reload()
                live = set(r.entries)
                still = [(e, r.entry_problem(e, scratch)) for e, _ in bad if e in live]
                bad = [(e, w) for e, w in still if w]
                if bad:
                    notes.append("the store is open in another process; rechecked once")
        problems += [Problem(f"slot {e.slot}", what, e.key, e.slot) for e, what in bad]
        return checked, problems, notes

    def repair(self, problems: Iterable[Problem]) -> int:
        """Reopening the store drops index entries whose header disagrees and rewrites a
        damaged journal; then the named blocks that fail a verified read are freed."""
        suspects = {(p.key, p.slot) for p in problems if p.key is not None}
        with contextlib.closing(self._open_tier()) as tier:
            dropped: int = tier.open_report.get("blocks_dropped", 0)
            held = [(k, s) for k, s in tier.recover() if (k, s) in suspects]
            step = max(1, READ_BATCH_BYTES // tier.block_bytes)
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

    def drop(self, blocks: Iterable[BlockInfo]) -> int:
        want = {(b.key, b.slot) for b in blocks}
        with contextlib.closing(self._open_tier()) as tier:
            slots = [s for k, s in tier.recover() if (k, s) in want]
            tier.free(slots)
            return len(slots)

    def check_free(self) -> None:
        with NVMeStoreReader(self.path) as r:
            if r.in_use():
                raise self._in_use()

    def _in_use(self) -> StoreError:
        return StoreError(
            f"{self.path} is open in another process; stop it before changing the store"
        )

    def _open_tier(self) -> Any:
        """The store as a tier that holds every slot (kept ones too) and every namespace's
        blocks, and writes none."""
        meta = read_meta(self.path)
        slab = os.stat(os.path.join(self.path, SLAB)).st_size
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # O_DIRECT is not asked for
                return self.tier_class(
                    name=self.name,
                    block_bytes=meta["block_bytes"],
                    capacity_blocks=max(meta["capacity_blocks"], slab // meta["slot_bytes"]),
                    path=self.path,
                    fsync="batch",
                    namespace=None,
                    direct=False,
                )
        except ConfigError as exc:
            if "in use" in exc.problem:
                raise self._in_use() from None
            raise
