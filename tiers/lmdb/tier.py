"""`LMDBTier` (the package docstring describes the store): this process's view of it, its
slot -> key map and counters, and the write path (`_commit`: pending deletes and puts in
`StoreTxn` transactions, map-full retries, the background sync). Tests patch the tunables
below on this module."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import lmdb
import numpy as np
import torch

from tiercache.errors import ConfigError
from tiercache.tiers.format import header_check, namespace_id
from tiercache.tiers.keyed import (
    CODEC_OPTIONS,
    KeyedTier,
    add_written,
    check_codec,
    check_seconds,
    compression_ratio,
    leading_clear,
)
from tiercache.tiers.lmdb import attach as lmdb_attach
from tiercache.tiers.lmdb import removals, scan
from tiercache.tiers.lmdb import warm as lmdb_warm
from tiercache.tiers.lmdb.env import attach, damaged, detach, map_size_for, pool, pool_map
from tiercache.tiers.lmdb.layout import (
    DIR_RULES,
    NS_BYTES,
    SYNC_MODES,
    StoreTxn,
    head_seq,
    heads_prober,
    txn_ops_for,
)
from tiercache.tiers.lmdb.offline import LMDBOffline, LMDBProbe
from tiercache.tiers.lmdb.removals import Removal
from tiercache.tiers.store_dir import prepare_dir

log = logging.getLogger("tiercache.tiers.lmdb")  # the package's one logger name

# "batch": the default seconds between background syncs (`sync_interval`): a longer interval
# rewrites fewer map pages per put, and an OS crash can lose about one interval.
SYNC_EVERY_S = 5.0
_RETRIES = 8
MAP_FULL_TRIES = 9  # a write that finds the map full waits 1+2+...+128 ms for readers to end
_PARALLEL_MIN_BYTES = 64 * 1024  # blocks at least this big are decoded on the thread pool
_EVICTED_MAX = 1 << 16  # take_evicted's memory of store evictions nobody took


def check_settings(o: Mapping[str, Any], where: str = "") -> float:
    """Value checks shared by the constructor and `validate_options` (ConfigError), with the
    constructor's defaults: the codec's, then `sync`, then `sync_interval` (returned)."""
    check_codec(o.get("compression", "zstd"), o.get("level", 1), o.get("element_size", 2), where)
    p = f"{where}." if where else ""
    sync = o.get("sync", "batch")
    if sync not in SYNC_MODES:
        raise ConfigError(f"{p}sync", f"expected one of {SYNC_MODES}, got {sync!r}")
    kept = o.get("removals_kept")
    if kept is not None and (isinstance(kept, bool) or not isinstance(kept, int) or kept < 1):
        raise ConfigError(f"{p}removals_kept", f"expected an int >= 1, got {kept!r}")
    return check_seconds(o.get("sync_interval", SYNC_EVERY_S), f"{p}sync_interval")


class LMDBTier(KeyedTier):
    """Blocks keyed by block key in LMDB; persistent and shareable between processes."""

    kind: ClassVar[str] = "lmdb"
    store_label: ClassVar[str] = "LMDB"
    persistent: ClassVar[bool] = True
    shared: ClassVar[bool] = True
    store_capacity: ClassVar[bool] = True  # the store evicts by it (`StoreTxn`)
    OPTIONS: ClassVar = {
        "path": str,
        **CODEC_OPTIONS,
        "sync": str,
        "sync_interval": (int, float),
        "removals_kept": int,
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
        sync_interval: float = SYNC_EVERY_S,
        namespace: str = "",
        lazy: bool = False,
        removals_kept: int | None = None,
    ) -> None:
        """`lazy`: index nothing at open when the store is well formed (the manager finds
        each block by `probe` on its first lookup); else index the newest `capacity`.
        `removals_kept`: block entries the removal log keeps for this namespace (default
        `removals.keep_for(capacity_blocks)`), for readers that tail it (`removals`)."""
        codec = {"compression": compression, "level": level, "element_size": element_size}
        settings = {"sync": sync, "sync_interval": sync_interval, "removals_kept": removals_kept}
        interval = check_settings({**codec, **settings})
        super().__init__(
            name=name, block_bytes=block_bytes, capacity_blocks=capacity_blocks, **codec
        )
        self._sync = sync
        self._sync_interval = interval
        self._ns = namespace_id(namespace)
        self._nsb = self._ns.to_bytes(NS_BYTES, "big")  # prefix of every store key of ours
        self._ours = header_check(self._ns, block_bytes)  # a probe's header check
        self._txn_ops = txn_ops_for(capacity_blocks)
        self._keep_removed = removals_kept or removals.keep_for(capacity_blocks)
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
        # Keys the store evicted by its capacity in this process's writes, not stored again
        # since: `take_evicted` (under `_counts_lock`; bounded where nobody takes them).
        self._evicted: set[bytes] = set()
        self._path = prepare_dir(path, DIR_RULES)  # only LMDB's own two files in it
        map_size = map_size_for(capacity_blocks, block_bytes, removals_kept=self._keep_removed)
        self._shared = attach(self._path, block_bytes, map_size, sync)
        self._token: bytes | None = None  # our attach entry (tiers/lmdb/attach.py)
        # The probe's check of leading keys (a malformed entry met is damage the lazy open
        # did not scan: dropped), bound to this store and namespace once.
        self._leading = heads_prober(
            self._shared.heads, self._shared.order, self._nsb, self._ours, self._drop_malformed
        )
        try:
            # Before the scan: a removal committed while it reads is tailed (at worst a key
            # the index never held, a no-op for the manager), never skipped.
            txn = self._begin(False, False)
            try:
                self._tail = removals.Tail(txn, self._shared.removed, self._nsb)
            finally:
                txn.abort()
            self._scan()
            self._register(namespace)
        except BaseException:
            self._closed = True
            detach(self._shared)
            raise

    @classmethod
    def validate_options(cls, options: Mapping[str, Any], where: str) -> None:
        super().validate_options(options, where)
        if not options.get("path"):
            raise ConfigError(f"{where}.path", "required: the directory of the LMDB store")
        check_settings(options, where)

    @classmethod
    def from_config(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> LMDBTier:
        fields = ("path", "block_bytes", "capacity")
        return cls.from_options(
            cfg, block_bytes, fields, namespace=namespace, lazy=True, **cfg.options
        )

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
        out["compression_ratio"] = compression_ratio(out)
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
            self._claim(slots, keys)  # fresh slots: no key of ours is replaced
            self._unpend(keys)
        return slots

    def _drop(self, slots: Sequence[int], *, held: bool) -> None:
        gone = self._release(slots)
        if gone:
            pending = self._shared.pending
            with self._shared.state_lock:
                (pending.hold if held else pending.add)(self._nsb + k for k in gone)

    def settle(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        with self._shared.state_lock:
            self._shared.pending.settle(self._nsb + k for k in keys)

    def probe(self, keys: Sequence[bytes]) -> int:
        """Leading `keys` with a well-formed header of this namespace in the environment
        (stored by another process since open); stops at a key this process is deleting."""
        if self._closed or not keys:
            return 0
        shared = self._shared
        # An empty set is read without the lock (one atomic length read, as the lock-held
        # snapshot is one instant): a single-key lookup's probe skips the lock's cost.
        if shared.pending.entries:  # stop where we delete
            keys = keys[: leading_clear(keys, self._deleting(), self._nsb)]
        try:  # `_begin`'s first try inline (a single-key lookup's probe runs it per key)
            txn = shared.env.begin(shared.blocks, None, False, False)
        except lmdb.Error:  # what `_begin` retries (other processes), or an error
            try:
                txn = self._begin(False, False)
            except OSError:
                return 0
        try:
            return self._leading(txn, keys)
        finally:
            txn.abort()

    def present(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key, what `probe([key])` would answer, in one read transaction (a key this
        process is deleting reads as gone, a malformed entry met is dropped as `probe`
        drops it); None when closed or when no transaction can begin."""
        if self._closed:
            return None
        if not keys:
            return []
        try:
            txn = self._begin(False, False)
        except OSError:
            return None
        try:
            return self._held(txn, keys)
        finally:
            txn.abort()

    def _held(self, txn: lmdb.Transaction, keys: Iterable[bytes]) -> list[bool]:
        """Per key, whether `txn`'s snapshot holds a good block of it that this process is
        not deleting (`present`'s answer; `_still_gone` asks it in the tail's transaction)."""
        pending, nsb, leading = self._deleting(), self._nsb, self._leading
        return [nsb + k not in pending and leading(txn, [k]) == 1 for k in keys]

    def _deleting(self) -> set[bytes]:
        """Store keys (namespace + key) this process is deleting: a probe reads them as gone."""
        shared = self._shared
        if not shared.pending.entries:  # read without the lock, as `probe` does
            return set()
        with shared.state_lock:
            return shared.pending.snapshot()

    def _drop_malformed(self, sk: bytes, head: bytes) -> None:
        """A probe found a malformed header (damage): its entries go at the next write
        transaction or flush, counted (`malformed_dropped`), as the eager open drops them."""
        log.warning("%s: dropping a malformed entry found by a lookup", self._path)
        self._shared.pend({sk: head_seq(head)})
        with self._counts_lock:
            self._counts["malformed_dropped"] += 1

    @classmethod
    def open_probe(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> LMDBProbe:
        return LMDBProbe(cfg.options["path"], block_bytes, namespace=namespace)

    @classmethod
    def offline_store(cls, path: str, name: str) -> LMDBOffline:
        return LMDBOffline(path)

    def _unpend(self, keys: Iterable[bytes], *, prefixed: bool = False) -> None:
        """Keys stored again (live: no pending delete may remove them any more) or deleted;
        `prefixed`: store keys, else block keys of this namespace."""
        skeys = keys if prefixed else (self._nsb + k for k in keys)
        with self._shared.state_lock:
            self._shared.pending.unpend(skeys)

    # -- write -----------------------------------------------------------------------------
    def write(
        self, slots: Sequence[int], src: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> None:
        """Store blocks by key: encoded (compressed before the txn), then put with the pending
        deletes (`_commit`). OSError (ENOSPC when the map is full): uncommitted deletes stay."""
        keys = self._io_keys(slots, src, keys, "src")
        n = len(slots)
        if n == 0:
            return
        rows = (src if src.device.type == "cpu" else src.cpu()).numpy()
        # LMDB records each slot's key before the commit (the txn may fail after; Redis
        # records after its send): the keys of ours these slots held go to the deletes.
        replaced = self._claim(slots, keys)
        if replaced:
            with self._shared.state_lock:
                self._shared.pending.add(self._nsb + k for k in replaced)
        self._unpend(keys)
        seq0 = self._shared.next_seq(n)

        def encode(i: int) -> tuple[bytes, bytes | memoryview]:
            return self._encode(keys[i], rows[i], seq0 + i, self._compressor())

        if self._compression == "zstd":
            # Compress before the write txn: the writer lock is held for puts only.
            encoded = pool_map(encode, n, parallel=self.block_bytes >= _PARALLEL_MIN_BYTES)
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
                ops: list[tuple[bytes, int]] = [(k, -1) for k in shared.pending.entries]
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
                    self._unpend(done, prefixed=True)  # deleted
                self._after_commit()
        with self._counts_lock:
            add_written(self._counts, len(skeys), len(skeys) * self.block_bytes, stored)

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
            store = StoreTxn(txn, sh.meta, sh.heads, sh.blocks, sh.order, sh.removed)
            with sh.state_lock:
                pending = dict(sh.pending.entries)
            for k, i in chunk:
                if i < 0:
                    store.delete(k, pending.get(k))
                else:
                    header, payload = encoded(i)
                    store.put(k, header, payload)
                    stored += len(payload)
            if any(i >= 0 for _, i in chunk):  # deletes alone never make room to trim
                store.evict(self._nsb, self.capacity_blocks)
            store.finish(keep=self._keep_removed)  # the removal log commits with them
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        put = [k[NS_BYTES:] for k, i in chunk if i >= 0]
        with self._counts_lock:
            self._evicted.difference_update(put)  # stored again: held, not evicted
            if store.evicted:
                self._counts["store_evictions"] += len(store.evicted)
                if len(self._evicted) > _EVICTED_MAX:  # nobody takes them: keep it bounded
                    self._evicted.clear()
                self._evicted.update(store.evicted)
        return stored

    def take_evicted(self) -> list[bytes]:
        """Keys of this namespace the store removed since the last call and does not hold
        now (`Tier.take_evicted`): those its capacity evicted in this tier's write
        transactions, and every block any other process's writes removed (evicted or
        deleted), read from the removal log's tail. So an index on a shared store drops
        another process's evictions at its next call, instead of claiming them held (a put
        would skip them) until a read finds them gone."""
        with self._counts_lock:
            own, self._evicted = self._evicted, set()
        return list(self._still_gone(own))

    def _still_gone(self, own: set[bytes]) -> set[bytes]:
        """`own` and the keys of the removal log's records since the last tail, those the
        store lacks now, in one read transaction (a key stored again since is held: not
        reported). The log is advice: a record trimmed before it was read leaves its keys to
        be found gone by a read; without a transaction, `own` as it is."""
        if self._closed:
            return own
        with self._tail.lock:
            try:
                txn = self._begin(False, False)
            except OSError:
                return own
            try:
                new = self._tail.take(txn)
                if not new and not own:
                    return own
                asked = list(own.union(r.key for r in new))
                held = self._held(txn, asked)
                return {k for k, h in zip(asked, held, strict=True) if not h}
            except lmdb.Error as exc:
                log.warning("%s: cannot read the removal log: %s", self._path, exc)
                return own
            finally:
                txn.abort()

    def removals(self, after: int = -1) -> list[Removal]:
        """The blocks of this namespace that any process's write transactions removed, in
        records committed after order seq `after`, oldest first (`removals.read`): a reader
        that follows a shared store learns of every process's evictions, including those of
        a process killed before it reported them. Writers keep the newest `removals_kept`
        entries (default `removals.keep_for(capacity)`); an older `after` finds the oldest
        kept."""
        txn = self._begin(write=False, buffers=False)
        try:
            return list(removals.read(txn, self._shared.removed, self._nsb, after))
        except lmdb.Error as exc:
            raise self._os_error("read of the removal log", exc) from None
        finally:
            txn.abort()

    def _txn_clearing(
        self, chunk: Sequence[tuple[bytes, int]], encoded: Callable[[int], tuple[bytes, Any]]
    ) -> int:
        """`_txn`, again while the map is full for a moment. A reader pins the pages freed
        after its snapshot: a process killed inside a read txn pins them for good (its slot
        stays in the reader table), so dead readers are cleared; a live reader of another
        process pins them until it ends, so the write waits for it before it fails."""
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
        """Delete keys one txn each (write lock held); a key LMDB cannot delete leaves the
        pending deletes (its block stays, a counted miss); one that found the map full stays."""
        done = []
        for k in keys:
            try:
                self._txn([(k, -1)], lambda i: (b"", b""))
            except lmdb.MapFullError:
                continue
            except lmdb.Error as exc:
                log.warning("%s: cannot delete damaged entry %s: %s", self._path, k.hex(), exc)
            done.append(k)
        self._unpend(done, prefixed=True)

    def _after_commit(self) -> None:
        shared = self._shared
        if self._sync == "never" or shared.durable:
            return
        if self._sync == "always":  # an env opened by a "batch" tier of this process
            self._env_sync()
            return
        with shared.state_lock:
            # One background sync at a time, at most one per interval (from its start).
            due = time.monotonic() - shared.last_sync >= self._sync_interval
            if due and (shared.bg_sync is None or shared.bg_sync.done()):
                shared.last_sync = time.monotonic()
                shared.bg_sync = pool("sync").submit(shared.background_sync)

    def _env_sync(self) -> None:
        shared = self._shared
        try:
            shared.wait_sync()
            shared.env.sync(True)
        except lmdb.Error as exc:
            raise self._os_error("sync", exc) from None
        with shared.state_lock:
            shared.last_sync = time.monotonic()

    # -- read ------------------------------------------------------------------------------
    def _read_rows(self, keys: Sequence[bytes], rows: np.ndarray) -> list[int]:
        """A missing key (a plain miss: `take_gone`) or a foreign or corrupt block (deleted at
        the next write txn) is a failed position. OSError when no read txn can be had."""
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
            lmdb_warm.will_need(f[3] for f in found)  # readahead is off: see env._open_env
            parallel = self.block_bytes >= _PARALLEL_MIN_BYTES

            def decode(j: int) -> bool:
                i, k, h, v = found[j]
                return self._decode_block(k, h, v, rows[i])

            ok = pool_map(decode, len(found), parallel)
            for (i, k, h, _), good in zip(found, ok, strict=True):
                if not good:
                    failed.append(i)
                    bad[nsb + k] = head_seq(h)
        finally:
            txn.abort()  # the zero-copy views die here, after every copy above finished
        failed.sort()
        if bad:
            self._shared.pend(bad)
        with self._counts_lock:
            self._counts["blocks_read"] += len(keys) - len(failed)
            self._counts["read_failures"] += len(failed) - len(gone)
            self._counts["blocks_gone"] += len(gone)
        self._note_gone(gone)
        return failed

    # -- recovery and lifecycle ------------------------------------------------------------
    def _scan(self) -> None:
        """Index what `scan.scan` finds of this namespace (nothing when lazy and the store is
        well formed); malformed entries it finds are deleted by this tier's commit."""
        found = scan.scan(
            self._shared,
            scan.Scope(self._path, self._ns, self.capacity_blocks, self.block_bytes),
            lazy=self._lazy,
            check=self._header,
            begin=self._begin,
            commit=lambda: self._commit([], lambda i: (b"", b"")),
        )
        self.open_report = found.report
        self._take_found(found.keys)

    def _register(self, namespace: str) -> None:
        """Record this namespace's capacity and name and this tier's attach entry (`attach`),
        in a write txn of its own after the scan: the records never change a block."""
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
                log.warning("%s: map full: this tier is not shown as attached", self._path)
            except lmdb.Error as exc:
                raise ConfigError("path", damaged(self._path, exc)) from None
            finally:
                txn.abort()  # nothing after a commit

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
            detach(self._shared)  # syncs and closes the environment with its last user
        self._slot_key.clear()

    # -- helpers ---------------------------------------------------------------------------
    def _begin(self, write: bool, buffers: bool = True) -> lmdb.Transaction:
        """A transaction (default db: blocks); retries what other processes cause briefly. A
        read returns memoryviews into the map unless `buffers` is False (bytes)."""
        shared = self._shared
        for attempt in range(_RETRIES):
            try:
                # positional: py-lmdb parses keywords slowly (a probe begins one per lookup)
                return shared.env.begin(shared.blocks, None, write, buffers and not write)
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
