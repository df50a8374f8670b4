"""`NVMeStoreReader`: offline, read-only access to an NVMe store for the CLI (inspect,
verify, evict): it takes no lock and writes nothing. `headers()`: the good blocks' headers,
one copy per block; `entry_problem(entry, scratch)`: what is wrong with an entry's block."""

from __future__ import annotations

import contextlib
import fcntl
import os

import numpy as np

from tiercache.errors import BlockCorruptError
from tiercache.tiers.format import CODEC_RAW, HEADER_SIZE, BlockHeader, decode_payload, header_of
from tiercache.tiers.nvme.journal import JournalEntry, newest_copies, replay_journal
from tiercache.tiers.nvme.layout import INDEX, META, SLAB, open_nofollow, read_meta


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

    def headers(self) -> tuple[list[tuple[JournalEntry, BlockHeader]], int]:
        """Each good block the journal names with its header (payloads not read), the newest
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
        return list(newest.values()), bad

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
