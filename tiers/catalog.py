"""`Catalog`: small records beside the blocks of a shared store, in write order, bounded.

Engines sharing a store (LMDB on a host, Redis for a fleet) learn from it which blocks the
others stored, and how to describe them (issue 51: the connector's KV events,
`connectors/vllm_kv/shared_blocks.py`). The catalog holds opaque bytes per block key; it never
holds or checks the blocks themselves (presence is the store's `StoreProbe`'s answer).

- `put(items)`: (key, record) pairs, appended in write order (a key put again moves to the
  end); beyond `capacity` records the oldest are dropped, as the store drops its oldest
  blocks, so a catalog holds about what its store holds and never grows past it.
- `since(cursor, limit)`: records written after `cursor` (0: from the oldest), oldest
  first, and the cursor to ask from next; a reader that fell more than `capacity` behind
  gets what is left.
- `close()`.

`LMDBCatalog`: an LMDB environment of its own beside the store's directory (one per
namespace under `<path>.catalog/`: the store's directory holds only LMDB's two files),
opened once per process (reference counted) and shared by every process on the host.
`RedisCatalog`: a sorted set of keys by write sequence and one string per record, under the
store's prefix; Redis may evict records under `maxmemory` like blocks (a missing record
reads as none), and its counter or sorted set too (allkeys-*): the next sequence is past
both the counter and the newest record, and a reader whose cursor is past everything the
catalog holds (it was evicted whole) reads it again from the start.
"""

from __future__ import annotations

import hashlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import lmdb

__all__ = ["CATALOG_ERRORS", "Catalog", "LMDBCatalog", "RedisCatalog", "catalog_path"]


def _errors() -> tuple[type[BaseException], ...]:
    out: list[type[BaseException]] = [OSError, ValueError, lmdb.Error]
    try:
        import redis

        out.append(redis.RedisError)
    except ImportError:
        pass
    return tuple(out)


CATALOG_ERRORS = _errors()  # what a catalog's calls raise when its store misbehaves

_SEQ = b"seq"  # the meta entry: the next write sequence number (8 bytes, big-endian)


class Catalog(ABC):
    """Records beside a shared store's blocks (see the module doc)."""

    @abstractmethod
    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None: ...

    @abstractmethod
    def since(self, cursor: int, limit: int = 4096) -> tuple[list[tuple[bytes, bytes]], int]: ...

    @abstractmethod
    def close(self) -> None: ...


def catalog_path(store_path: str) -> str:
    """Where the catalog of the LMDB store at `store_path` lives."""
    return (
        os.path.realpath(os.path.abspath(os.path.expanduser(store_path))).rstrip("/") + ".catalog"
    )


_OPEN: dict[str, tuple[Any, int]] = {}  # real path -> (environment, references)
_OPEN_LOCK = threading.Lock()


class LMDBCatalog(Catalog):
    """The catalog of one LMDB store (see the module doc); `capacity`: records kept."""

    def __init__(
        self, store_path: str, capacity: int, *, namespace: str = "", record_bytes: int = 2048
    ) -> None:
        ns = hashlib.sha256(namespace.encode()).hexdigest()[:16]
        self._path = os.path.join(catalog_path(store_path), ns)
        self.capacity = max(1, capacity)
        with _OPEN_LOCK:
            env, refs = _OPEN.get(self._path, (None, 0))
            if env is None:
                os.makedirs(self._path, mode=0o700, exist_ok=True)  # per namespace
                size = (self.capacity * (record_bytes + 256) * 2 + (64 << 20)) // 4096 * 4096
                env = lmdb.open(self._path, map_size=size, max_dbs=3, lock=True)
            _OPEN[self._path] = (env, refs + 1)
        self._env = env
        self._by_seq = env.open_db(b"by_seq")  # seq (8 bytes) -> key
        self._records = env.open_db(b"records")  # key -> seq (8 bytes) + record
        self._meta = env.open_db(b"meta")
        self._closed = False

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not items or self._closed:
            return
        with self._env.begin(write=True) as txn:
            seq = int.from_bytes(txn.get(_SEQ, b"\0" * 8, db=self._meta), "big") or 1
            for key, record in items:
                old = txn.get(key, db=self._records)
                if old is not None:
                    txn.delete(old[:8], db=self._by_seq)
                sb = seq.to_bytes(8, "big")
                txn.put(sb, key, db=self._by_seq)
                txn.put(key, sb + record, db=self._records)
                seq += 1
            txn.put(_SEQ, seq.to_bytes(8, "big"), db=self._meta)
            over = txn.stat(self._by_seq)["entries"] - self.capacity
            if over > 0:
                cur = txn.cursor(db=self._by_seq)
                cur.first()
                for _ in range(over):
                    txn.delete(cur.value(), db=self._records)
                    if not cur.delete():
                        break

    def since(self, cursor: int, limit: int = 4096) -> tuple[list[tuple[bytes, bytes]], int]:
        out: list[tuple[bytes, bytes]] = []
        if self._closed:
            return out, cursor
        with self._env.begin() as txn:
            cur = txn.cursor(db=self._by_seq)
            if not cur.set_range((cursor + 1).to_bytes(8, "big")):
                return out, cursor
            for sb, key in cur:
                rec = txn.get(key, db=self._records)
                cursor = int.from_bytes(sb, "big")
                if rec is not None and rec[:8] == sb:
                    out.append((bytes(key), bytes(rec[8:])))
                if len(out) >= limit:
                    break
        return out, cursor

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _OPEN_LOCK:
            env, refs = _OPEN[self._path]
            if refs <= 1:
                del _OPEN[self._path]
                env.close()
            else:
                _OPEN[self._path] = (env, refs - 1)


# The next write sequence for ARGV[1] records: past the counter (KEYS[1]) and past the
# newest record (KEYS[2]), whichever Redis kept, so a reader's cursor is never ahead of it.
_NEXT_SEQ = """
local top = tonumber(redis.call('GET', KEYS[1]) or '0')
local last = redis.call('ZREVRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if last[2] and tonumber(last[2]) > top then top = tonumber(last[2]) end
top = top + tonumber(ARGV[1])
redis.call('SET', KEYS[1], top)
return top
"""


class RedisCatalog(Catalog):
    """The catalog of one Redis store (see the module doc), on a `redis.Redis` client."""

    def __init__(self, client: Any, prefix: bytes, capacity: int) -> None:
        """`prefix`: the store's key prefix (prefix + namespace); one node, not a cluster (the
        catalog's keys would span hash slots)."""
        self._r = client
        self._order = prefix + b"#catalog:order"
        self._seq = prefix + b"#catalog:seq"
        self._rec = prefix + b"#catalog:rec:"
        self.capacity = max(1, capacity)

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not items:
            return
        top = int(self._r.eval(_NEXT_SEQ, 2, self._seq, self._order, len(items)))
        pipe = self._r.pipeline(transaction=False)
        for i, (key, record) in enumerate(items):
            pipe.zadd(self._order, {key: top - len(items) + 1 + i})
            pipe.set(self._rec + key, record)
        pipe.execute()
        over = int(self._r.zcard(self._order)) - self.capacity
        if over > 0:
            old = self._r.zrange(self._order, 0, over - 1)
            if old:
                pipe = self._r.pipeline(transaction=False)
                pipe.zrem(self._order, *old)
                pipe.delete(*[self._rec + bytes(k) for k in old])
                pipe.execute()

    def since(self, cursor: int, limit: int = 4096) -> tuple[list[tuple[bytes, bytes]], int]:
        pipe = self._r.pipeline(transaction=False)
        pipe.zrangebyscore(self._order, f"({cursor}", "+inf", start=0, num=limit, withscores=True)
        pipe.zrevrange(self._order, 0, 0, withscores=True)
        rows, last = pipe.execute()
        if not rows:
            if cursor > 0 and (not last or last[0][1] < cursor):  # evicted whole: again
                return self.since(0, limit)
            return [], cursor
        recs = self._r.mget([self._rec + bytes(k) for k, _ in rows])
        out = [(bytes(k), bytes(v)) for (k, _), v in zip(rows, recs, strict=True) if v is not None]
        return out, int(rows[-1][1])

    def close(self) -> None:
        self._r.close()
