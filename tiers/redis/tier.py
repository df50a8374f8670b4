"""`RedisTier` (the package docstring describes the store): settings checks, the open
(metadata check, SCAN of what the store holds), availability and its back-off, the slot
index with its pending deletes, and the pipelined reads and writes.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tiercache.backoff import Backoff
from tiercache.errors import BlockCorruptError, ConfigError
from tiercache.tiers.base import KEY_BYTES
from tiercache.tiers.format import HEADER_SIZE, header_check, header_of, is_header_of, namespace_id
from tiercache.tiers.keyed import (
    CODEC_OPTIONS,
    KeyedTier,
    PendingDeletes,
    add_written,
    check_codec,
    check_seconds,
    compression_ratio,
    leading_clear,
)
from tiercache.tiers.redis.client import (
    DEFAULT_URL,
    META_SUFFIX,
    NET_ERRORS,
    STORE_FORMAT,
    STORE_VERSION,
    auth_error,
    close_client,
    glob_escape,
    make_client,
    parse_nodes,
    pipeline,
    secret,
    shown,
)
from tiercache.tiers.store_dir import MetaFormat, over_capacity

log = logging.getLogger(__package__)  # "tiercache.tiers.redis"

PIPELINE_BYTES = 64 << 20  # most value bytes in one pipeline execute (bounds client memory)
SCAN_BATCH = 1000
BACKOFF_START_S = 0.1
# The store's metadata key (format, version, block size): a mismatch names the prefix.
_META_FORMAT = MetaFormat(
    "Redis",
    STORE_FORMAT,
    STORE_VERSION,
    field="prefix",
    advice="choose another prefix",
    other="prefix",
)
_COUNTERS = (
    "blocks_written",
    "raw_bytes",
    "stored_bytes",
    "blocks_read",
    "missing",  # key absent: expired, evicted by Redis, deleted elsewhere
    "corrupt",  # a value under our key that is not a good block of that key
    "failed_calls",  # a batch that failed on the network or was refused by Redis
    "skipped_calls",  # calls answered "unavailable" without touching the network
    "disconnects",
    "reconnects",
)


def check_settings(o: Mapping[str, Any], where: str = "") -> None:
    """Value checks shared by the constructor and `validate_options` (ConfigError)."""
    p = f"{where}." if where else ""
    parse_nodes(o.get("url", DEFAULT_URL), f"{p}url")
    check_codec(o.get("compression", "none"), o.get("level", 1), o.get("element_size", 2), where)
    ttl = o.get("ttl")
    if ttl is not None:
        check_seconds(ttl, f"{p}ttl", allow_zero=True)
    check_seconds(o.get("timeout", 0.5), f"{p}timeout")
    check_seconds(o.get("backoff_max", 5.0), f"{p}backoff_max")
    prefix = o.get("prefix", "tiercache:")
    if not isinstance(prefix, str):
        raise ConfigError(f"{p}prefix", f"expected a string, got {type(prefix).__name__}")
    for name in ("username", "password", "username_env", "password_env"):
        v = o.get(name)
        if v is not None and (not isinstance(v, str) or not v):
            raise ConfigError(f"{p}{name}", "expected a non-empty string")
    for name in ("username", "password"):
        if o.get(name) is not None and o.get(f"{name}_env") is not None:
            raise ConfigError(f"{p}{name}_env", f"give {name} or {name}_env, not both")


class RedisTier(KeyedTier):
    """Blocks keyed by prefix + namespace + block key in Redis; persistent and shared."""

    kind: ClassVar[str] = "redis"
    store_label: ClassVar[str] = "Redis"
    persistent: ClassVar[bool] = True
    shared: ClassVar[bool] = True
    present_unlocked: ClassVar[bool] = True  # a network round trip (its own lock inside)
    OPTIONS: ClassVar = {
        "url": (str, list),
        "username": str,
        "password": str,
        "username_env": str,
        "password_env": str,
        "ttl": (int, float),
        "prefix": str,
        **CODEC_OPTIONS,
        "timeout": (int, float),
        "backoff_max": (int, float),
    }

    def __init__(
        self,
        *,
        name: str = "redis",
        block_bytes: int,
        capacity_blocks: int,
        url: str | Sequence[str] = DEFAULT_URL,
        username: str | None = None,
        password: str | None = None,
        username_env: str | None = None,
        password_env: str | None = None,
        ttl: float | None = None,
        prefix: str = "tiercache:",
        compression: str = "none",
        level: int = 1,
        element_size: int = 2,
        timeout: float = 0.5,
        backoff_max: float = 5.0,
        namespace: str = "",
        index_at_open: bool = True,
    ) -> None:
        codec = {"compression": compression, "level": level, "element_size": element_size}
        super().__init__(
            name=name, block_bytes=block_bytes, capacity_blocks=capacity_blocks, **codec
        )
        settings = {
            "url": list(url) if isinstance(url, tuple) else url,
            "username": username,
            "password": password,
            "username_env": username_env,
            "password_env": password_env,
            "ttl": ttl,
            "prefix": prefix,
            **codec,
            "timeout": timeout,
            "backoff_max": backoff_max,
        }
        check_settings({k: v for k, v in settings.items() if v is not None})
        self._cluster, self._target = parse_nodes(settings["url"])
        self._url_shown = shown(self._target)
        self._username = secret(username, username_env, "username")
        self._password = secret(password, password_env, "password")
        self._ttl_ms = int(ttl * 1000) if ttl else None
        self._timeout = float(timeout)
        self._ns = namespace_id(namespace)
        self._kprefix = prefix.encode() + namespace.encode()
        self._meta_key = self._kprefix + META_SUFFIX
        self._lock = threading.Lock()  # slot map, pending deletes, availability, counters
        self._pending = PendingDeletes()  # freed keys still in Redis (see free)
        self._keep: set[bytes] = set()  # keys unreadable only because Redis was down
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._seq = 0
        self._client: Any = None
        self._up = False
        # Unavailable: calls fail fast until the wait ends (0.1 s doubling up to backoff_max).
        # period=start: a failure before the first success (at open) waits twice the start.
        self._backoff = Backoff(BACKOFF_START_S, float(backoff_max), period=BACKOFF_START_S)
        self._last_error = ""
        # False: a probe (`open_probe`), indexing nothing and writing nothing at open.
        self._index_at_open = index_at_open
        try:
            self._open()
        except BaseException:
            self._shutdown_client()
            self._closed = True
            raise

    @classmethod
    def validate_options(cls, options: Mapping[str, Any], where: str) -> None:
        super().validate_options(options, where)
        check_settings(options, where)

    @classmethod
    def from_config(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> RedisTier:
        return cls.from_options(cfg, block_bytes, None, namespace=namespace, **cfg.options)

    @classmethod
    def open_probe(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> RedisTier:
        """The tier without its index (no SCAN and no metadata write at open): its `probe`
        answers 0 at once during a back-off; an unreachable server is not an error here."""
        return cls.from_options(
            cfg, block_bytes, (), namespace=namespace, index_at_open=False, **cfg.options
        )

    # -- connection and availability -------------------------------------------------------
    def _make_client(self) -> Any:
        return make_client(
            self._target,
            self._cluster,
            timeout=self._timeout,
            username=self._username,
            password=self._password,
        )

    def _open(self) -> None:
        """Connect, check the store's metadata and index what it holds. An unreachable server
        is not fatal (the tier starts unavailable and retries); bad credentials are (the
        constructor then closes the client)."""
        try:
            client = self._make_client()
            self._client = client
            client.ping()
            if self._index_at_open:
                self._check_meta(client)
                self._scan(client)
        except AuthenticationError as exc:
            raise auth_error(exc, self._url_shown) from None
        except ResponseError as exc:
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                raise auth_error(exc, self._url_shown) from None
            raise ConfigError("url", f"Redis at {self._url_shown} refused us: {exc}") from None
        except RedisClusterException as exc:
            if "auth" in str(exc).lower() or "WRONGPASS" in str(exc):
                raise auth_error(exc, self._url_shown) from None
            self._mark_down(exc, "open")
            return
        except NET_ERRORS as exc:
            self._mark_down(exc, "open")
            return
        self._up = True

    def _check_meta(self, client: Any) -> None:
        meta = {"format": STORE_FORMAT, "version": STORE_VERSION, "block_bytes": self.block_bytes}
        try:
            client.set(self._meta_key, json.dumps(meta, sort_keys=True).encode(), nx=True)
        except ResponseError as exc:  # e.g. OOM under maxmemory: only the check below matters
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                raise
        raw = client.get(self._meta_key)
        where = f"{self._meta_key!r} on {self._url_shown}"
        got = meta if raw is None else _META_FORMAT.parse(raw, where)
        _META_FORMAT.check_block_bytes(
            got.get("block_bytes"), self.block_bytes, f"the store under {self._kprefix!r}"
        )

    def _conn(self) -> Any:
        """The client, or OSError at once while the tier is in its backoff window."""
        with self._lock:
            self._check_open()
            if self._up or self._backoff.ready():
                if self._client is not None:
                    return self._client
            else:
                self._counts["skipped_calls"] += 1
                wait = self._backoff.remaining()
                raise OSError(
                    errno.EAGAIN,
                    f"{self.medium}: Redis at {self._url_shown} unavailable "
                    f"({self._last_error}); next try in {wait:.2f} s",
                )
        # Down with no client yet (a cluster unreachable at open): build it now, outside the
        # lock; the cluster client contacts its nodes in the constructor.
        try:
            client = self._make_client()
        except RedisError as exc:
            self._mark_down(exc, "connect")
            raise OSError(errno.ECONNREFUSED, f"{self.medium}: connect failed: {exc}") from None
        with self._lock:
            if self._client is None:
                self._client, client = client, None
            kept = self._client
        if client is not None:  # another thread's client won
            self._close_quietly(client)
        return kept

    def _mark_up(self) -> None:
        if self._up:
            return
        with self._lock:
            if self._up:
                return
            self._up = True
            self._backoff.succeed()
            self._counts["reconnects"] += 1
        log.warning("%s: Redis at %s is reachable again", self.medium, self._url_shown)

    def _mark_down(self, exc: BaseException, what: str) -> None:
        with self._lock:
            self._counts["failed_calls"] += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            if self._up:  # the first failure after a success (or a good open) waits `start`
                self._counts["disconnects"] += 1
                self._backoff.succeed()
            was_up, self._up = self._up, False
            self._backoff.fail()
        if was_up or what == "open":
            log.warning(
                "%s: Redis at %s unavailable during %s (%s); retrying with backoff",
                self.medium,
                self._url_shown,
                what,
                self._last_error,
            )

    def _run(self, client: Any, cmds: list[list[Any]], what: str) -> list[Any]:
        """`client.pipeline(client, cmds, cluster)`: one reply per command, errors in the list;
        OSError (and the tier marked down) on network failure."""
        try:
            out = pipeline(client, cmds, self._cluster)
        except AuthenticationError as exc:
            self._mark_down(exc, what)
            raise OSError(
                errno.EACCES, f"{self.medium}: {auth_error(exc, self._url_shown)}"
            ) from None
        except (*NET_ERRORS, RedisError) as exc:
            self._mark_down(exc, what)
            raise OSError(
                errno.ETIMEDOUT if isinstance(exc, RedisTimeoutError) else errno.ECONNREFUSED,
                f"{self.medium}: Redis {what} failed: {type(exc).__name__}: {exc}",
            ) from None
        self._mark_up()
        return out

    # -- introspection ---------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """False while Redis is unreachable (calls fail fast until the backoff expires)."""
        return self._up and not self._closed

    @property
    def retry_at(self) -> float:
        """The `time.monotonic()` time from which calls try Redis again after a failure (0.0
        while it is reachable): before it they fail fast, and a probe answers 0."""
        with self._lock:
            return 0.0 if self._up else self._backoff.until

    @property
    def key_prefix(self) -> bytes:
        """prefix + namespace: every block of this store lives under it."""
        return self._kprefix

    def side_client(self) -> tuple[Any, bool]:
        """A new client of this tier's server (its timeouts and credentials) for records kept
        beside the blocks (`tiers.catalog`), and whether the server is a cluster."""
        return self._make_client(), self._cluster

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key holding block `key`."""
        return self._kprefix + key

    def stats(self) -> dict[str, Any]:
        """Counters of this tier object (see module docstring), availability, pending deletes."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["available"] = self._up and not self._closed
            out["pending_deletes"] = len(self._pending)
        out["compression_ratio"] = compression_ratio(out)
        return out

    # -- slots -----------------------------------------------------------------------------
    def allocate(self, keys: Sequence[bytes]) -> list[int] | None:
        slots = super().allocate(keys)
        if slots:
            with self._lock:
                self._pending.unpend(keys)
        return slots

    def probe(self, keys: Sequence[bytes]) -> int:
        """Leading `keys` whose value starts with a good header of this namespace (one pipelined
        GETRANGE); stops at a key this instance is deleting; 0 while Redis is unreachable."""
        if self._closed or not keys:
            return 0
        with self._lock:
            pending = self._pending.snapshot()
        try:
            client = self._conn()
            heads = self._run(
                client,
                [["GETRANGE", self._kprefix + k, b"0", b"%d" % (HEADER_SIZE - 1)] for k in keys],
                "probe",
            )
        except OSError:
            return 0
        stop = leading_clear(keys, pending)
        ours = header_check(self._ns, self.block_bytes)
        return next((i for i in range(stop) if not ours(heads[i], keys[i])), stop)

    def present(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Whether Redis holds each of `keys` (None while unreachable or closed; a key this
        instance is deleting reads as gone, as in `probe`): one pipelined EXISTS, which
        leaves the keys' LRU/LFU as it was (a sweep that read every block would make them
        all look just used, and `maxmemory` evict what was really used last). So, unlike
        `probe`, it checks no header: a value under a block's key that is not a good block
        of it (damage) reads as held here, and as a miss plus an error when read (Redis 7.2's
        CLIENT NO-TOUCH would allow a header read that keeps LRU/LFU)."""
        if not keys:
            return []
        with self._lock:
            pending = self._pending.snapshot()
        try:
            cmds = [["EXISTS", self._kprefix + k] for k in keys]
            held = self._run(self._conn(), cmds, "sweep")
        except (OSError, RuntimeError):  # unreachable, or closed
            return None
        return [v == 1 and k not in pending for k, v in zip(keys, held, strict=True)]

    def _drop(self, slots: Sequence[int], *, held: bool) -> None:
        with self._lock:
            # Only keys we stored (not found, adopted, or a failed write) are to delete.
            delete = []
            for k in self._release(slots):
                if k in self._keep:
                    self._keep.discard(k)  # dropped only because Redis was unreachable
                else:
                    delete.append(k)
            (self._pending.hold if held else self._pending.add)(delete)

    def settle(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        with self._lock:
            self._pending.settle(keys)

    # -- write -----------------------------------------------------------------------------
    def write(
        self, slots: Sequence[int], src: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> None:
        """Store blocks by key: one pipelined SET each (with the ttl) after the pending deletes.
        OSError when Redis is unreachable or refuses: unsent deletes stay pending."""
        keys = self._io_keys(slots, src, keys, "src")
        n = len(slots)
        if n == 0:
            return
        client = self._conn()
        rows = (src if src.device.type == "cpu" else src.cpu()).numpy()
        seq0 = self._next_seq(n)
        zc = self._compressor()
        values = [self._encode(keys[i], rows[i], seq0 + i, zc) for i in range(n)]
        stored = sum(len(payload) for _, payload in values)
        with self._lock:
            self._pending.unpend(keys)
            dels = taken = list(self._pending.take())
        rkeys = [self._kprefix + k for k in keys]
        px = self._ttl_ms
        try:
            for a, b in self._chunks(n):
                cmds: list[list[Any]] = [["DEL", self._kprefix + d] for d in dels]
                for i in range(a, b):
                    cmd = ["SET", rkeys[i], values[i]]
                    cmds.append([*cmd, "PX", b"%d" % px] if px else cmd)
                out = self._run(client, cmds, "write")
                errors = [r for r in out if isinstance(r, Exception)]
                if errors:
                    with self._lock:
                        self._counts["failed_calls"] += 1
                    raise OSError(errno.EIO, f"{self.medium}: Redis refused a write: {errors[0]}")
                dels = []
        except OSError:
            with self._lock:  # deletes not sent stay pending
                self._pending.restore(dels, stored=set(keys))
                self._pending.sent(taken)  # those of the chunks that went through
            raise
        with self._lock:
            # Claimed after the send (LMDB claims before its commit): a failed write leaves
            # the slots unowned, so freeing them deletes nothing.
            self._pending.sent(taken)
            self._pending.add(self._claim(slots, keys))
            self._keep.difference_update(keys)
            self._pending.unpend(keys)
            add_written(self._counts, n, n * self.block_bytes, stored)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        per = max(1, PIPELINE_BYTES // (self.block_bytes + HEADER_SIZE))
        return [(a, min(n, a + per)) for a in range(0, n, per)]

    def _next_seq(self, n: int) -> int:
        """Write sequence: wall-clock microseconds, monotonic in this process, so recovery
        orders blocks by recency across instances too."""
        with self._lock:
            first = max(self._seq, time.time_ns() // 1000)
            self._seq = first + n
            return first

    # -- read ------------------------------------------------------------------------------
    def _read_rows(self, keys: Sequence[bytes], rows: np.ndarray) -> list[int]:
        """A missing key or a corrupt or foreign value is a failed position; OSError when
        Redis is unreachable."""
        n = len(keys)
        px = self._ttl_ms
        failed: list[int] = []
        gone: list[bytes] = []
        damaged: list[bytes] = []  # a block of ours whose bytes fail verification
        corrupt = 0
        try:
            client = self._conn()
            for a, b in self._chunks(n):
                if px:
                    pxb = b"%d" % px
                    cmds = [["GETEX", self._kprefix + keys[i], "PX", pxb] for i in range(a, b)]
                else:
                    cmds = [["GET", self._kprefix + keys[i]] for i in range(a, b)]
                vals = self._run(client, cmds, "read")
                for i, v in zip(range(a, b), vals, strict=True):
                    if v is None:
                        gone.append(keys[i])
                        failed.append(i)
                    elif isinstance(v, Exception) or not self._decode(keys[i], v, rows[i]):
                        corrupt += 1
                        failed.append(i)
                        if isinstance(v, bytes) and is_header_of(
                            v[:HEADER_SIZE], keys[i], self._ns, self.block_bytes
                        ):
                            damaged.append(keys[i])
        except OSError:  # unreachable: the cache drops these keys, but their blocks are fine
            with self._lock:
                self._keep.update(keys)
            raise
        with self._lock:
            c = self._counts
            c["blocks_read"] += n - len(failed)
            c["missing"] += len(gone)
            c["corrupt"] += corrupt
            # No instance can use a damaged block of ours: deleted with the next write or
            # flush, whoever stored it (probe stops at it meanwhile). A value that is not a
            # block of ours (another type, a foreign string) is never deleted.
            self._pending.add(damaged)
        self._note_gone(gone)  # expired, evicted by the server, deleted by another instance
        if corrupt:
            log.warning("%s: %d corrupt or foreign values read as misses", self.medium, corrupt)
        return failed

    def _decode(self, key: bytes, v: object, row: np.ndarray) -> bool:
        """Check and copy one value into `row`; False if it is not a good block of `key`."""
        if not isinstance(v, bytes):
            return False  # not a string value
        return self._decode_block(key, v, memoryview(v)[HEADER_SIZE:], row)

    # -- recovery and lifecycle ------------------------------------------------------------
    def _scan(self, client: Any) -> None:
        """Index the newest `capacity` good blocks of this namespace found in Redis."""
        pattern = glob_escape(self._kprefix) + b"?" * KEY_BYTES
        found: list[tuple[int, bytes]] = []
        want = len(self._kprefix) + KEY_BYTES
        scanned = (bytes(rk) for rk in client.scan_iter(match=pattern, count=SCAN_BATCH))
        ours = (rk for rk in scanned if len(rk) == want and rk.startswith(self._kprefix))
        while batch := list(itertools.islice(ours, SCAN_BATCH)):
            pipe = client.pipeline(transaction=False)
            for rk in batch:
                pipe.getrange(rk, 0, HEADER_SIZE - 1)
            for rk, head in zip(batch, pipe.execute(raise_on_error=False), strict=True):
                if not isinstance(head, bytes):
                    continue
                k = rk[len(self._kprefix) :]
                try:
                    found.append((header_of(head, k, self._ns, self.block_bytes).seq, k))
                except BlockCorruptError:
                    continue  # not ours to delete: a foreign value under a look-alike key
        found.sort()
        # Over capacity at open: the newest `capacity` are indexed, silently (the server's
        # maxmemory bounds a shared store, not one instance's capacity).
        kept = found[over_capacity(len(found), self.capacity_blocks) :]
        if kept:
            self._seq = max(self._seq, kept[-1][0] + 1)
        self._take_found([k for _, k in kept])

    def flush(self) -> None:
        """Send pending deletes (Redis's own persistence decides durability)."""
        if self._closed:
            return
        with self._lock:
            dels = list(self._pending.take())
        if not dels:
            return
        try:
            client = self._conn()
            self._run(client, [["DEL", self._kprefix + d] for d in dels], "delete")
        except OSError:
            with self._lock:
                self._pending.restore(dels)
            raise
        with self._lock:
            self._pending.sent(dels)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._pending and self._up:
                self.flush()
        except OSError as exc:
            log.warning("%s: pending deletes not sent at close: %s", self.medium, exc)
        finally:
            self._closed = True
            self._shutdown_client()
            self._slot_key.clear()

    def _shutdown_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            self._close_quietly(client)

    def _close_quietly(self, client: Any) -> None:
        """Close `client` and its pool's sockets: the tier builds its clients on a pool of
        its own, which `Redis.close` leaves connected."""
        try:
            close_client(client)
        except RedisError as exc:  # pragma: no cover - closing sockets rarely fails
            log.debug("%s: closing the client: %s", self.medium, exc)

    def __repr__(self) -> str:
        return (
            f"RedisTier(medium={self.medium!r}, url={self._url_shown!r}, "
            f"block_bytes={self.block_bytes}, used={self.used_blocks}/{self.capacity_blocks}, "
            f"available={self.available})"
        )
