"""`SharedBlocks`: every engine attached to a shared store reports the blocks it can load
from it, whoever stored them, and reports them removed once the store no longer holds them
(issue 51; docs/events.md).

- Descriptions beside the blocks: when the scheduler's `EventTranslator` sees a described
  block held in a shared tier, its description (`encode`: msgpack, never pickle) goes into
  the store's `Catalog` (`tiers/catalog.py`), bounded like the store.
- Discovery (`poll`): records written since this engine's cursor (at attach: the whole
  catalog, a snapshot of the store) whose block the store holds (its `StoreProbe`) are
  reported stored in that tier; a block this engine already has as held there is skipped,
  one not in the store yet is asked about again at the next `retry_polls` polls.
- Hashes: a record carries its writer's vLLM hashes and hash identity (algorithm and
  NONE_HASH). A reader with the same identity reports them as they are; one with another
  (a different algorithm, or a random per-process NONE_HASH: xxhash without PYTHONHASHSEED)
  recomputes them with its own hash function from the record's tokens, tagged extra keys
  and its own hash of the parent block (recorded by parent key); a block whose parent it
  cannot describe is not reported.
- Removals the cache reports from a shared tier stand only for blocks the store no longer
  holds (`still_held`, asked by the worker: a block the cache merely forgot stays reported).
- Removals (`poll`): a sweep asks the probe about `sweep_keys` of the keys held in each
  shared tier per poll, round robin (`EventTranslator.rotate`: O(sweep_keys) a poll, however
  many are held), in one `StoreProbe.present` call (LMDB: one read transaction; Redis: one
  pipelined EXISTS, which leaves the keys' LRU as it was, where a read would make every
  block look just used; head shards: every shard's key in that call, a block held when all
  are), and reports those gone (another process's eviction, Redis's maxmemory or expiry)
  removed; an unreachable store (None) has nothing gone. A block gone from the store is
  reported removed within ceil(held / sweep_keys) polls, blocks stored or removed meanwhile
  included; polls run at most every `interval_s`, from vLLM's `take_events` (every engine
  step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from tiercache.config import CacheConfig
from tiercache.connectors.probes import open_probes
from tiercache.connectors.vllm_kv.kv_events import BlockDescriptor, EventTranslator
from tiercache.connectors.vllm_kv.settings import log
from tiercache.tiers.base import StoreProbe
from tiercache.tiers.catalog import CATALOG_ERRORS, Catalog, LMDBCatalog, RedisCatalog

__all__ = [
    "SharedBlocks",
    "TierProbe",
    "decode",
    "encode",
    "hash_identity",
    "open_shared_blocks",
    "still_held",
]

RECORD_VERSION = 1


def hash_identity(algo: str) -> tuple[bytes, Any]:
    """This process's vLLM hash identity (algorithm name and NONE_HASH) and hash function."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name(algo)
    none = getattr(kv_cache_utils, "NONE_HASH", None)
    if none is None:  # vLLM's engine sets it at start; a bare process: as vLLM would
        kv_cache_utils.init_none_hash(fn)
        none = kv_cache_utils.NONE_HASH
    return algo.encode() + b":" + bytes(none), fn


def encode(desc: BlockDescriptor, identity: bytes) -> bytes:
    return msgspec.msgpack.encode(
        {
            "v": RECORD_VERSION,
            "id": identity,
            "h": list(desc.hashes),
            "p": desc.parent,
            "pk": desc.parent_key,
            "t": list(desc.token_ids),
            "bs": desc.block_size,
            "li": desc.lora_id,
            "ln": desc.lora_name,
            "x": desc.extra_keys,
            "xt": desc.tagged,
        }
    )


def _tuples(x: Any) -> Any:
    """msgpack gives lists where vLLM hashed tuples: back to tuples, all the way down."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list | tuple) else x


def decode(raw: bytes) -> dict[str, Any] | None:
    """A record, or None when it is not one this version reads (malformed: ignored)."""
    try:
        rec = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("v") != RECORD_VERSION:
        return None
    t, h, bs = rec.get("t"), rec.get("h"), rec.get("bs")
    if not (isinstance(t, list) and isinstance(h, list) and h and isinstance(bs, int) and bs > 0):
        return None
    if len(t) != bs * len(h) or not all(isinstance(x, bytes) for x in h):
        return None
    return rec


class SharedBlocks:
    """Credit and removals for the shared tiers of one engine (see the module doc)."""

    def __init__(
        self,
        catalogs: Sequence[tuple[str, Catalog]],
        probes: dict[str, StoreProbe],
        hash_algo: str = "sha256",
        *,
        interval_s: float = 0.5,
        sweep_keys: int = 4096,
        read_limit: int = 4096,
        retry_polls: int = 20,
        expand: Callable[[Sequence[bytes]], list[bytes]] | None = None,
        own_probes: bool = True,
    ) -> None:
        """`expand`: a block key -> the keys the store holds it under (head shards: every
        shard's; default: the key itself). `own_probes` False: another owner closes them."""
        self._catalogs = [(t, c) for t, c in catalogs if t in probes]
        self._probes = probes
        self._own_probes = own_probes
        self._algo = hash_algo
        self._identity: bytes | None = None
        self._hash_fn: Any = None
        self._interval = interval_s
        self._sweep = sweep_keys
        self._read_limit = read_limit
        self._next = 0.0
        self._cursor = {t: 0 for t, _ in self._catalogs}
        self._publish: dict[str, list[tuple[bytes, BlockDescriptor]]] = {}
        # Recorded but not (yet) in the store when first asked (its writer's transaction not
        # visible yet): asked again at the next `retry_polls` polls. key -> polls left.
        self._retry: dict[str, dict[bytes, int]] = {t: {} for t, _ in self._catalogs}
        self._retry_polls = retry_polls
        self._quiet = False  # applying what the catalog told: not written back into it
        self._expand = expand

    def _has(self, probe: StoreProbe, key: bytes) -> bool:
        """The store holds block `key` (every key it is stored under)."""
        keys = self._expand([key]) if self._expand is not None else [key]
        return probe.probe(keys) == len(keys)

    def _ident(self) -> bytes:
        if self._identity is None:
            self._identity, self._hash_fn = hash_identity(self._algo)
        return self._identity

    def on_shared(self, key: bytes, tier: str, desc: BlockDescriptor) -> None:
        """`EventTranslator`'s hook: `key` is held in shared `tier`; written at the next poll."""
        if tier in self._cursor and not self._quiet:
            self._publish.setdefault(tier, []).append((key, desc))

    def poll(self, tr: EventTranslator, *, force: bool = False) -> None:
        """Publish, discover and sweep, at most every `interval_s` (`force`: now)."""
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + self._interval
        ident = self._ident()
        for tier, cat in self._catalogs:
            probe = self._probes[tier]
            try:
                mine = self._publish.pop(tier, [])
                try:
                    cat.put([(k, encode(d, ident)) for k, d in mine])
                except CATALOG_ERRORS:  # a timeout: written at the next poll, not lost
                    self._publish[tier] = mine[-self._read_limit :]
                    raise
                self._quiet = True
                self._discover(tr, tier, cat, probe)
                self._sweep_tier(tr, tier, probe)
            except CATALOG_ERRORS as exc:  # advisory: events never fail an engine step
                log.warning("tiercache: shared blocks of tier %s: %s", tier, exc)
            finally:
                self._quiet = False

    def _discover(self, tr: EventTranslator, tier: str, cat: Catalog, probe: StoreProbe) -> None:
        retry = self._retry[tier]
        if retry:
            back = [
                k
                for k in retry
                if not tr.holds(k, tier) and tr.described(k) and self._has(probe, k)
            ]
            for k in list(retry):
                retry[k] -= 1
                if retry[k] <= 0 or k in back:
                    del retry[k]
            if back:
                tr.apply(back, tier, False)
        while True:
            recs, self._cursor[tier] = cat.since(self._cursor[tier], self._read_limit)
            found: list[bytes] = []
            for key, raw in recs:
                if tr.holds(key, tier):
                    continue
                if not tr.described(key):
                    d = self._descriptor(tr, raw)
                    if d is None:
                        continue
                    tr.record(key, d)
                if self._has(probe, key):
                    found.append(key)
                elif len(retry) < self._read_limit:
                    retry[key] = self._retry_polls
            if found:
                tr.apply(found, tier, False)
            if len(recs) < self._read_limit:
                return

    def _sweep_tier(self, tr: EventTranslator, tier: str, probe: StoreProbe) -> None:
        """The sweep of `tier` (module doc, Removals)."""
        part = tr.rotate(tier, self._sweep)
        if not part:
            return
        flags = self._present(probe, part)
        if flags is None:  # unreachable: nothing is known gone
            return
        gone = [k for k, held in zip(part, flags, strict=True) if not held]
        if gone:
            tr.apply(gone, tier, True)

    def _present(self, probe: StoreProbe, keys: Sequence[bytes]) -> list[bool] | None:
        """Per block key, whether the store holds it under every key it is stored under
        (`expand`), all asked in one `present` call; None when the store is unreachable."""
        if self._expand is None:
            return probe.present(keys)
        each = [self._expand([k]) for k in keys]
        flags = probe.present([x for e in each for x in e])
        if flags is None:
            return None
        out: list[bool] = []
        i = 0
        for e in each:
            out.append(all(flags[i : i + len(e)]))
            i += len(e)
        return out

    def _descriptor(self, tr: EventTranslator, raw: bytes) -> BlockDescriptor | None:
        rec = decode(raw)
        if rec is None:
            return None
        tagged = _tuples(rec["xt"]) if rec.get("xt") is not None else None
        extra = _tuples(rec["x"]) if rec.get("x") is not None else None
        common = {
            "token_ids": tuple(rec["t"]),
            "block_size": rec["bs"],
            "lora_id": rec.get("li"),
            "lora_name": rec.get("ln"),
            "extra_keys": extra,
            "parent_key": rec.get("pk"),
            "tagged": tagged,
        }
        if rec.get("id") == self._identity:
            return BlockDescriptor(hashes=tuple(rec["h"]), parent=rec.get("p"), **common)
        # Another hash identity: this engine's own hashes, chained from its parent's.
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        parent: bytes | None = None
        if rec.get("pk") is not None:
            pd = tr.describes(rec["pk"])
            if pd is None:
                return None
            parent = pd.hashes[-1]
        hashes: list[bytes] = []
        bs, tokens, prev = rec["bs"], rec["t"], parent
        for j in range(len(rec["h"])):
            extra_j = tagged[j] if tagged is not None else None
            prev = bytes(
                hash_block_tokens(self._hash_fn, prev, tokens[j * bs : (j + 1) * bs], extra_j)
            )
            hashes.append(prev)
        return BlockDescriptor(hashes=tuple(hashes), parent=parent, **common)

    def close(self) -> None:
        for _, cat in self._catalogs:
            cat.close()
        for p in self._probes.values() if self._own_probes else ():
            p.close()


def still_held(cache: Any, events: Sequence[Any]) -> list[bytes]:
    """Of the keys `events` report removed from a shared LMDB tier of `cache` (the worker's,
    its lock held), those the store still holds and the cache would find again: it forgot
    them (adopted, or found at open, and evicted from its smaller index), it did not delete
    them (a block it is deleting reads as gone). Still loadable: not removed for routers.
    Redis tiers are not asked (a round trip per key): their removals stand."""
    lmdb = {t.medium: t for t in cache.tiers if t.shared and t.kind == "lmdb"}
    out: list[bytes] = []
    for e in events:
        t = lmdb.get(e.medium) if e.removed else None
        held = t.present(e.keys) if t is not None else None  # None: closed, none kept
        if held:
            out.extend(k for k, h in zip(e.keys, held, strict=True) if h)
    return out


class TierProbe:
    """A `StoreProbe` over a tier of this process's cache, under the cache's lock: what its
    own lookups would find (a block this process is deleting reads as gone). `present` is
    asked without the lock where the tier says so (`present_unlocked`, Redis: a network
    round trip must not hold up the cache)."""

    def __init__(self, tier: Any, lock: Any) -> None:
        self._tier, self._lock = tier, lock

    def probe(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return int(self._tier.probe(keys))

    def present(self, keys: Sequence[bytes]) -> list[bool] | None:
        if self._tier.present_unlocked:
            return self._tier.present(keys)
        with self._lock:
            return self._tier.present(keys)

    def close(self) -> None:
        pass


def open_shared_blocks(
    config: CacheConfig,
    block_bytes: int,
    hash_algo: str,
    *,
    interval_s: float = 0.5,
    local: tuple[Sequence[Any], Any] | None = None,
    borrowed: Sequence[tuple[str, StoreProbe]] | None = None,
    expand: Callable[[Sequence[bytes]], list[bytes]] | None = None,
) -> SharedBlocks | None:
    """`SharedBlocks` over `config`'s shared tiers (LMDB; Redis on one node), or None when
    it has none. `local`: (the cache's tiers, its lock) where the cache is this process's
    (local placement): presence is asked of those tiers; else of read-only probes, the
    scheduler's own (`borrowed`, closed by their owner: a process opens an LMDB environment
    once) or new ones."""
    own = borrowed is None
    probes: dict[str, Any] = dict(open_probes(config, block_bytes) if own else borrowed or ())
    catalogs: list[tuple[str, Catalog]] = []
    for t in config.tiers:
        probe = probes.get(t.name)
        if probe is None:
            continue
        cap = t.capacity_in_blocks(block_bytes)
        if t.kind == "lmdb":
            catalogs.append(
                (t.name, LMDBCatalog(t.options["path"], cap, namespace=config.namespace))
            )
        elif t.kind == "redis":  # its probe is the tier without an index (RedisTier)
            client, cluster = probe.side_client()
            if cluster:
                client.close()
                log.warning("tiercache: tier %s is a Redis cluster: no shared block events", t.name)
                continue
            catalogs.append((t.name, RedisCatalog(client, probe.key_prefix, cap)))
    for name in set(probes) - {t for t, _ in catalogs}:
        unused = probes.pop(name)
        if own:
            unused.close()
    if local is not None:
        for t, tier in zip(config.tiers, local[0], strict=True):
            if t.name in probes:
                probes.pop(t.name).close()
                probes[t.name] = TierProbe(tier, local[1])
    if not catalogs:
        return None
    return SharedBlocks(
        catalogs, probes, hash_algo, interval_s=interval_s, expand=expand, own_probes=own
    )
