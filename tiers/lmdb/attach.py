"""Who has an LMDB store open, and what each namespace's capacity and name are: records in the
environment's "meta" database, written by the LMDB tier, read by `tiercache inspect`.

Records (a missing one reads as unknown, so stores written before them need no new format):
- ``capacity:`` + namespace prefix -> u64 big-endian: the capacity in blocks of the last tier
  of that namespace that opened the store.
- ``name:`` + namespace prefix -> utf-8: the namespace as configured.
- ``attach:`` + 16 random bytes -> JSON {pid, host, namespace_id, opened_at, start,
  capacity_blocks}: one per open tier, put at open and deleted at close, each in a write
  transaction of its own. A killed process leaves its entry: `Attachment.state` tells
  "stale" (same host, the pid is gone or now names a process started later), and the next
  tier to open on that host deletes the stale entries of its host.

Primitives: `register(txn, meta_db, ...) -> token`, `unregister(txn, meta_db, token)`,
`read_records(txn, meta_db) -> StoreRecords`, `readers(env) -> list[Reader]` (LMDB's own
reader table). Values are parsed as JSON or integers, never unpickled; malformed ones skipped.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tiercache.tiers.lmdb.layout import NS_BYTES, iter_prefix

CAPACITY_PREFIX = b"capacity:"
NAME_PREFIX = b"name:"
ATTACH_PREFIX = b"attach:"
TOKEN_BYTES = 16
_MAX_VALUE = 4096  # an attach entry or a name longer than this is not ours: skipped


@dataclass(frozen=True)
class Attachment:
    """One tier that opened the store and has not closed it (or was killed)."""

    token: bytes
    pid: int
    host: str
    namespace_id: int
    opened_at: float
    start: int | None  # the process's start time (/proc/PID/stat, clock ticks), if known
    capacity_blocks: int | None

    @property
    def state(self) -> str:
        """ "live" (this host, the process runs), "stale" (this host, it is gone) or
        "unknown" (another host: its processes cannot be checked from here)."""
        if self.host != socket.gethostname():
            return "unknown"
        return "live" if pid_alive(self.pid, self.start) else "stale"


@dataclass(frozen=True)
class StoreRecords:
    """What the meta database says beside the blocks: per namespace id its recorded capacity
    and name, and the attach entries."""

    capacities: dict[int, int]
    names: dict[int, str]
    attached: tuple[Attachment, ...]


@dataclass(frozen=True)
class Reader:
    """One slot of LMDB's reader table (lock.mdb): a process that has read the store; `txn`
    is the snapshot it reads now, None between transactions."""

    pid: int
    thread: str
    txn: int | None


def process_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the command name, which may hold ')'
    try:
        return int(fields[19])  # field 22 of proc(5); fields[0] is field 3
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, start: int | None) -> bool:
    """Whether process `pid` of this host runs and, when `start` is known, is the one that
    started then (not a later process given the same pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    # /proc is read only when there is a start time to compare (`tiercache stats` has none)
    return start is None or process_start(pid) in (None, start)


def _under(txn: Any, db: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    return ((k, bytes(v)) for k, v in iter_prefix(txn.cursor(db=db), prefix, values=True))


def _parse_attach(token: bytes, raw: bytes) -> Attachment | None:
    if len(raw) > _MAX_VALUE:
        return None
    try:
        d = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(d, dict):
        return None
    pid, host, nid = d.get("pid"), d.get("host"), d.get("namespace_id")
    at, start, cap = d.get("opened_at"), d.get("start"), d.get("capacity_blocks")

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not (is_int(pid) and isinstance(host, str) and is_int(nid)):
        return None
    if isinstance(at, bool) or not isinstance(at, int | float):
        return None
    start, cap = (v if is_int(v) else None for v in (start, cap))
    return Attachment(token, pid, host, nid, float(at), start, cap)


def read_records(txn: Any, meta_db: Any) -> StoreRecords:
    """The capacity, name and attach records of a store, read in `txn` (read-only)."""
    caps, names, attached = {}, {}, []
    for k, v in _under(txn, meta_db, CAPACITY_PREFIX):
        if len(k) == len(CAPACITY_PREFIX) + NS_BYTES and len(v) == 8:
            caps[int.from_bytes(k[len(CAPACITY_PREFIX) :], "big")] = int.from_bytes(v, "big")
    for k, v in _under(txn, meta_db, NAME_PREFIX):
        if len(k) == len(NAME_PREFIX) + NS_BYTES and len(v) <= _MAX_VALUE:
            try:
                names[int.from_bytes(k[len(NAME_PREFIX) :], "big")] = v.decode()
            except UnicodeDecodeError:
                continue
    for k, v in _under(txn, meta_db, ATTACH_PREFIX):
        a = _parse_attach(k[len(ATTACH_PREFIX) :], v)
        if a is not None:
            attached.append(a)
    attached.sort(key=lambda a: a.opened_at)
    return StoreRecords(caps, names, tuple(attached))


def register(txn: Any, meta_db: Any, *, nsb: bytes, namespace: str, capacity: int) -> bytes:
    """In write txn `txn`: record the namespace's capacity and name, delete this host's stale
    attach entries, and add one for this process's tier; its token (for `unregister`)."""
    cap = capacity.to_bytes(8, "big")
    if txn.get(CAPACITY_PREFIX + nsb, db=meta_db) != cap:
        txn.put(CAPACITY_PREFIX + nsb, cap, db=meta_db)
    name = namespace.encode()
    if 0 < len(name) <= _MAX_VALUE and txn.get(NAME_PREFIX + nsb, db=meta_db) is None:
        txn.put(NAME_PREFIX + nsb, name, db=meta_db)
    host = socket.gethostname()
    for k, v in list(_under(txn, meta_db, ATTACH_PREFIX)):
        a = _parse_attach(k[len(ATTACH_PREFIX) :], v)
        if a is not None and a.host == host and a.state == "stale":
            txn.delete(k, db=meta_db)
    token = secrets.token_bytes(TOKEN_BYTES)
    entry = {
        "pid": os.getpid(),
        "host": host,
        "namespace_id": int.from_bytes(nsb, "big"),
        "opened_at": time.time(),
        "start": process_start(os.getpid()),
        "capacity_blocks": capacity,
    }
    txn.put(ATTACH_PREFIX + token, json.dumps(entry, sort_keys=True).encode(), db=meta_db)
    return token


def unregister(txn: Any, meta_db: Any, token: bytes) -> None:
    """In write txn `txn`: delete the attach entry `token` (absent: nothing to do)."""
    txn.delete(ATTACH_PREFIX + token, db=meta_db)


def readers(env: Any) -> list[Reader]:
    """LMDB's reader table of `env` (`mdb_reader_list`): one row per slot. A slot stays with
    a process from its first read until it closes the environment; the slots of a process
    that died stay until a writer or `reader_check` clears them."""
    out = []
    for line in env.readers().splitlines():
        f = line.split()
        if len(f) != 3 or not f[0].isdigit():
            continue  # the title line, or "(no active readers)"
        txn = int(f[2]) if f[2].isdigit() else None
        out.append(Reader(int(f[0]), f[1], txn))
    return out


__all__ = [
    "Attachment",
    "Reader",
    "StoreRecords",
    "pid_alive",
    "process_start",
    "read_records",
    "readers",
    "register",
    "unregister",
]
