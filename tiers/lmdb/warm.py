"""Warm an LMDB store's index pages into the page cache, never its payloads.

After a lazy open (`LMDBTier(lazy=True)`) every first lookup of a key probes the store: its
"heads" entry and its "order" entry, one or more B-tree pages each, and with the page cache
dropped each is a synchronous disk read. `warm_index` reads the B-tree pages of the named
databases level by level (branch pages with `pread`, so their children are known) and asks
the kernel for each level's pages at once (`POSIX_FADV_WILLNEED`: many reads in flight), so
the leaves arrive in one pass at the disk's throughput instead of one latency per lookup.
Then, when this process maps the environment, it maps those pages into its own page tables
(`MADV_POPULATE_READ`, Linux 5.14), sparing a first lookup its minor page faults.

Primitives:
- `tree_roots(fd, psize, names)`: (name, root page, depth) of each named database;
- `warm_index(path, names)`: the warm pass; a summary (pages asked for, mapped, seconds);
- `map_base(data_file)`: where this process maps a file from its start (/proc/self/maps);
- `will_need(views)`: `MADV_WILLNEED` on the map pages of values that span several pages
  (readahead is off: a cold value would otherwise be read one page fault at a time).

Only pages of the databases named are touched, never "blocks". It is a hint: anything that
does not parse as expected ends the pass (no error).

LMDB's on-disk layout (lmdb.h / mdb.c, 64-bit, format version 1), as read here:
- page header (16 bytes): pgno u64, pad u16, flags u16, lower u16, upper u16; the node
  offsets (u16) follow it, (lower - 16) / 2 of them;
- node: lo u16, hi u16, flags u16, ksize u16, key; a branch node's child page number is
  lo | hi << 16 | flags << 32;
- meta (pages 0 and 1, after the page header): magic u32, version u32, address u64,
  mapsize u64, two MDB_db records of 48 bytes (free, main), last_pg u64, txnid u64;
  MDB_db: pad u32, flags u16, depth u16, branch/leaf/overflow pages and entries u64,
  root u64. A named database is a main-db leaf node (key: its name, data: its MDB_db).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tiercache.tiers.base import PAGE_BYTES, libc_madvise

MAGIC = 0xBEEFC0DE
P_BRANCH, P_LEAF, P_META = 0x01, 0x02, 0x08
F_SUBDATA = 0x02
_HDR = struct.Struct("<QHHHH")
_NODE = struct.Struct("<HHHH")
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_META_AT = _HDR.size
_DBS_AT = _META_AT + 4 + 4 + 8 + 8
_TXNID_AT = _DBS_AT + 2 * _DB.size + 8
NO_PAGE = (1 << 64) - 1  # P_INVALID: an empty database
MADV_WILLNEED = 3
MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels answer EINVAL (then nothing is mapped)


def will_need(views: Iterable[Any]) -> None:
    """Ask the kernel to read in, asynchronously and in one go per value, the map pages of
    each value (zero-copy views into the map) longer than a page. Errors are ignored."""
    for v in views:
        if len(v) <= PAGE_BYTES:
            continue
        addr = np.frombuffer(v, dtype=np.uint8).ctypes.data
        start = addr - addr % PAGE_BYTES
        libc_madvise()(start, addr + len(v) - start, MADV_WILLNEED)


def map_base(data_file: str) -> int | None:
    """The address where this process maps `data_file` from its first byte, or None."""
    want = os.path.realpath(data_file)
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.rstrip("\n").split(maxsplit=5)
                if len(parts) == 6 and parts[5] == want and int(parts[2], 16) == 0:
                    return int(parts[0].split("-")[0], 16)
    except (OSError, ValueError):
        return None
    return None


def _populate(base: int, psize: int, runs: Sequence[tuple[int, int]]) -> int:
    """Map pages [start, end) of each run, at `base` in this process, into its page tables;
    how many pages. Stops at the first error (an old kernel, a map that moved). A read fault
    changes no data, so a map closed or moved meanwhile is harmless."""
    madvise, mapped = libc_madvise(), 0
    for start, end in runs:
        if madvise(base + start * psize, (end - start) * psize, MADV_POPULATE_READ) != 0:
            break
        mapped += end - start
    return mapped


class _Unexpected(Exception):
    """A page that does not read as the layout above (a writer moved on, or damage)."""


def _page(fd: int, psize: int, pgno: int) -> bytes:
    buf = os.pread(fd, psize, pgno * psize)
    if len(buf) != psize:
        raise _Unexpected(f"short read of page {pgno}")
    return buf


def _nodes(page: bytes) -> Iterable[tuple[int, int, int, int, int]]:
    """(lo, hi, flags, ksize, offset of the key) of each node of a branch or leaf page."""
    _pg, _pad, _flags, lower, upper = _HDR.unpack_from(page)
    if not _HDR.size <= lower <= upper <= len(page):
        raise _Unexpected("bad lower/upper")
    for i in range((lower - _HDR.size) // 2):
        (off,) = struct.unpack_from("<H", page, _HDR.size + 2 * i)
        if not upper <= off <= len(page) - _NODE.size:
            raise _Unexpected("node offset out of the page")
        lo, hi, fl, ks = _NODE.unpack_from(page, off)
        yield lo, hi, fl, ks, off + _NODE.size


def _children(page: bytes) -> list[int]:
    return [lo | hi << 16 | fl << 32 for lo, hi, fl, _ks, _at in _nodes(page)]


def tree_roots(fd: int, psize: int, names: Sequence[bytes]) -> list[tuple[bytes, int, int]]:
    """(name, root page, depth) of each of `names` found in the main database, as the newest
    meta page records it (an empty database has no root and is left out)."""
    best: tuple[int, bytes] | None = None
    for m in (0, 1):
        page = _page(fd, psize, m)
        (magic,) = struct.unpack_from("<I", page, _META_AT)
        (txnid,) = struct.unpack_from("<Q", page, _TXNID_AT)
        if magic == MAGIC and (best is None or txnid > best[0]):
            best = (txnid, page)
    if best is None:
        raise _Unexpected("no meta page")
    main = _DB.unpack_from(best[1], _DBS_AT + _DB.size)
    want, found = set(names), []
    level = [main[7]] if main[7] != NO_PAGE else []
    while level:  # the main database holds a handful of entries: walk it page by page
        nxt = []
        for pgno in level:
            page = _page(fd, psize, pgno)
            flags = _HDR.unpack_from(page)[2]
            if flags & P_BRANCH:
                nxt += _children(page)
                continue
            if not flags & P_LEAF:
                raise _Unexpected("main database page is neither branch nor leaf")
            for _lo, _hi, fl, ks, at in _nodes(page):
                name = page[at : at + ks]
                if fl & F_SUBDATA and name in want:
                    rec = _DB.unpack_from(page, at + ks)
                    if rec[7] != NO_PAGE:
                        found.append((bytes(name), rec[7], rec[2]))
        level = nxt
    return found


def _advise(fd: int, psize: int, pages: Iterable[int]) -> list[tuple[int, int]]:
    """POSIX_FADV_WILLNEED each run of consecutive pages; the runs, [start, end)."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(pages)):
        if runs and p == runs[-1][1]:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    for start, end in runs:
        os.posix_fadvise(fd, start * psize, (end - start) * psize, os.POSIX_FADV_WILLNEED)
    return runs


def warm_index(path: str, names: Sequence[bytes], psize: int | None = None) -> dict[str, float]:
    """Bring every B-tree page (branch and leaf) of the databases `names` of the environment
    in `path` into the page cache, and into this process's map of it where it has one."""
    t0 = time.perf_counter()
    psize = psize or max(4096, os.sysconf("SC_PAGE_SIZE"))
    data = os.path.join(path, "data.mdb")
    fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
    runs: list[tuple[int, int]] = []
    try:
        size = os.fstat(fd).st_size // psize
        # (page, levels from it down to the leaves, itself included): a level at a time.
        level = [(root, depth) for _name, root, depth in tree_roots(fd, psize, names)]
        while level:
            if any(not 2 <= p < size or d < 1 for p, d in level):
                raise _Unexpected("page number beyond the file, or a bad depth")
            runs += _advise(fd, psize, (p for p, _d in level))
            nxt: list[tuple[int, int]] = []
            for pgno, depth in level:
                if depth > 1:  # a branch page: read it (it is on its way) for its children
                    page = _page(fd, psize, pgno)
                    if not _HDR.unpack_from(page)[2] & P_BRANCH:
                        raise _Unexpected("a branch page expected")
                    nxt += [(c, depth - 1) for c in _children(page)]
            level = nxt  # the leaves are only asked for: nothing below them is an index
    except _Unexpected:
        pass
    finally:
        os.close(fd)
    # After the pass, every page asked for: the reads are in flight at once, so mapping
    # them waits for the slowest, not for each in turn.
    base = map_base(data) if runs else None
    mapped = _populate(base, psize, runs) if base is not None and psize % PAGE_BYTES == 0 else 0
    pages = sum(end - start for start, end in runs)
    return {"pages": pages, "mapped": mapped, "seconds": time.perf_counter() - t0}
