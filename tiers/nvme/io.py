"""The NVMe tier's I/O primitives: a complete `pwrite`, a small file written durably,
page-aligned slot buffers, the slab's opening (O_DIRECT where the filesystem takes it, with
its probe) and size, `slot_runs` (a call's slots as runs of adjacent slots, one syscall
each), `SlotPipeline` (syscalls on a pool, buffers filled and checked on the caller's
thread) and `Slab` (what a read or write of slots needs of the open slab)."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiercache.tiers.nvme.layout import SLAB, open_file
from tiercache.tiers.store_dir import reserve

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers (the common logical block)


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        view, offset = view[n:], offset + n


def write_file(path: str, name: str, data: bytes, *, sync: bool) -> None:
    """Write `data` as the whole store file `name` in directory `path` (`layout.open_file`),
    synced before it returns where `sync` (then it is durable before a rename publishes it)."""
    fd = open_file(path, name, os.O_WRONLY | os.O_TRUNC)
    try:
        write_all(fd, data, 0)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class SlotRun:
    """`count` adjacent slots from `first`, read or written with one syscall. `members`:
    (k, i) for each position i of the caller's list that names slot `first + k` (a read may
    name a slot twice: read once, decoded for both)."""

    first: int
    count: int
    members: tuple[tuple[int, int], ...]


def slot_runs(slots: Sequence[int], max_slots: int) -> list[SlotRun]:
    """`slots` as runs of consecutive slot numbers, at most `max_slots` each, by slot (in
    any order: the run a slot lands in does not change what is read or written there)."""
    if max_slots < 1:
        raise ValueError(f"max_slots: expected an int >= 1, got {max_slots!r}")
    order = sorted(range(len(slots)), key=slots.__getitem__)
    runs: list[SlotRun] = []
    first = count = -1
    members: list[tuple[int, int]] = []
    for i in order:
        s = slots[i]
        if members and s == first + count - 1:  # the same slot again (reads only)
            members.append((count - 1, i))
            continue
        if not members or s != first + count or count == max_slots:
            if members:
                runs.append(SlotRun(first, count, tuple(members)))
            first, count, members = s, 0, []
        members.append((count, i))
        count += 1
    if members:
        runs.append(SlotRun(first, count, tuple(members)))
    return runs


class AlignedBuffer:
    """A page-aligned buffer (anonymous mmap) with memoryview and numpy views."""

    __slots__ = ("arr", "mm", "view")

    def __init__(self, size: int) -> None:
        self.mm = mmap.mmap(-1, size)
        self.view = memoryview(self.mm)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)


def open_slab(path: str, direct: bool, medium: str) -> tuple[int, bool]:
    """The slab file of the store at `path`, opened for O_DIRECT I/O where `direct` and the
    filesystem takes it at open, else buffered (a RuntimeWarning says so): (fd, direct)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return open_file(path, SLAB, os.O_RDWR | os.O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _warn_buffered(path, medium, exc)
    return open_file(path, SLAB, os.O_RDWR), False


def direct_works(fd: int, path: str, medium: str) -> bool:
    """Whether O_DIRECT I/O works on the slab `fd`: some filesystems accept it at open and
    refuse it per I/O, so one read is tried. A refusal (EINVAL) is warned about, as in
    `open_slab`; any other error is raised."""
    buf = AlignedBuffer(ALIGN)
    try:
        os.preadv(fd, [buf.mm], 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _warn_buffered(path, medium, exc)
        return False
    return True


def _warn_buffered(path: str, medium: str, exc: OSError) -> None:
    # stacklevel: the user's call that opened the tier (through the tier's open)
    warnings.warn(
        f"{path}: the filesystem refuses O_DIRECT ({exc.strerror}); the "
        f"{medium!r} tier uses buffered I/O (reads may come from the page "
        "cache)",
        RuntimeWarning,
        stacklevel=5,
    )


def resize_slab(fd: int, target: int, *, grow_only: bool, no_room: str) -> None:
    """Make the slab `target` bytes: grown with the space reserved now (`store_dir.reserve`:
    ConfigError(`no_room`) on a full disk), or cut to it unless `grow_only`."""
    size = os.fstat(fd).st_size
    if size < target:
        if reserve(fd, size, target - size, no_room=no_room) is not None:
            os.ftruncate(fd, target)  # a filesystem that cannot preallocate
    elif size > target and not grow_only:
        os.ftruncate(fd, target)


class SlotPipeline:
    """A pool of `io_threads` threads for slot syscalls, with aligned buffers of `run_slots`
    slots each kept between calls (one item of `run` is one slot or one run of slots).

    The pool threads only run pread/pwrite (they release the GIL); the caller's thread fills
    and checks the buffers meanwhile, keeping up to 2 * io_threads items in flight so the
    device queue stays full while it copies and hashes."""

    def __init__(self, io_threads: int, slot_bytes: int, name: str, run_slots: int = 1) -> None:
        if run_slots < 1:
            raise ValueError(f"run_slots: expected an int >= 1, got {run_slots!r}")
        self._io_threads = io_threads
        self._slot_bytes = slot_bytes
        self.run_slots = run_slots
        # Aligned run buffers kept between calls, one stack for reads and one for writes: a
        # buffer an O_DIRECT write had read from was seen to take later reads much slower.
        self._spare: dict[bool, list[AlignedBuffer]] = {False: [], True: []}
        self._spare_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            io_threads, thread_name_prefix=name
        )

    def run(self, n: int, io: Any, before: Any, after: Any, *, writes: bool = False) -> list[Any]:
        """For i in 0..n-1: `before(i, buf)` (caller), `io(i, buf)` (pool), `after(i, buf,
        result_or_exception)` (caller, in order). Returns the values of `after`. `writes`:
        the syscalls write from the buffers (they come from the write stack)."""
        pool = self._pool
        assert pool is not None
        depth = min(n, 2 * self._io_threads)
        spare = self._spare[writes]
        with self._spare_lock:
            bufs = [
                spare.pop() if spare else AlignedBuffer(self.run_slots * self._slot_bytes)
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
                spare.extend(bufs)
        return out

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass(frozen=True, slots=True)
class Slab:
    """An open slab as its reads and writes see it: the file `fd`, slots of `slot_bytes`
    holding blocks of `block_bytes`, and the `pipeline` their syscalls run on."""

    fd: int
    slot_bytes: int
    block_bytes: int
    pipeline: SlotPipeline
