"""`LMDBTier`: blocks in an embedded LMDB environment, shareable between processes.

Primitives (on top of the `Tier` ABC):
- `write(slots, src, keys)`: one batched write transaction per call (split only past
  `txn_ops_for`); zstd (2-byte-plane shuffle) compression runs before the transaction, on
  a thread pool, and is kept only when it pays.
- `read(slots, dst, keys)`: one read transaction, zero-copy gets, header and key checks,
  checksum verified on every block; a missing or bad block is a failed position.
- `free(slots)`: a block this tier stored since it opened is deleted in the next write
  transaction or at `flush()` (a demotion planned with the eviction reads it first);
  blocks found at open or adopted are only forgotten.
- `take_gone(keys)`: the failed reads that were plain misses (the store evicted the block).
- `take_evicted()`: the blocks this tier's own write transactions evicted by the store's
  capacity, and those any other process's removed (the removal log's tail), that the store
  does not hold now: the manager drops them from its index and reports them removed.
- `removals(after)`: every block of its namespace any process removed (evicted or deleted),
  from the store's removal log, which each write transaction commits with its removals.
- `recover()`, `flush()`, `close()`, `stats()`.

Layout. Databases "meta" (JSON: store format, version, block_bytes; each namespace's block
count, capacity, name and attach entries; the next order seq), "heads" (store key -> the
64-byte `tiers.format` header + the 8-byte order seq), "blocks" (store key -> stored
payload), "order" (namespace prefix + order seq -> block key, oldest first) and
"removed" (the removal log: `removals`; store format 4, added in place to a format 3 store
by its first write open). Header and
payload are two values put in one write transaction, so the payload goes from the caller's
tensor straight into the map (py-lmdb has no MDB_RESERVE) and an open reads header pages
only; the checksum still covers both. The store key is the 8-byte namespace id followed by
the 16-byte block key (`store_key`): a tier reads, counts, scans and deletes only keys under
its own namespace's prefix. Slots are handles only: a read goes by key.

Capacity belongs to the store: every transaction that stores evicts its namespace's oldest
blocks beyond the capacity (`StoreTxn`), whichever process runs it; that process reports
them (`take_evicted`), every other reads them from the removal log at its next
`take_evicted` (or finds them gone at a read before that). Opening deletes no good block: a
tier indexes the newest `capacity` of its namespace from the order entries (headers only), in
bulk where the namespace is well formed, entry by entry (dropping only the malformed ones)
where it is not (`scan`).

The map is opened with `readahead=False`: a page fault reads its page alone, so a write
dirties and a sync writes back only the pages it touched, and an open or a cold lookup reads
index pages, not payloads. What wants more asks for it: `read` advises the kernel of each
multi-page payload (`warm.will_need`), and a lazy open warms the "heads" and "order" pages in
the background (`warm.warm_index`).

Sharing. One `lmdb.Environment` per real path per process, reference counted (LMDB refuses a
second open in one process). Any number of processes may open and write the same directory:
LMDB's writer mutex serializes write transactions, readers never block. A process sees
blocks another stored through `probe` on a lookup miss; a process that does not hold the
store as a tier (vLLM's scheduler) asks it through `LMDBProbe`: headers only, read-only.

Durability (`sync`): "always" opens the environment with sync and metasync (a write is
durable when it returns); "batch" commits without fsync, starts a background `env.sync`
after a commit at most every `sync_interval` seconds (writers do not wait for it) and syncs
in the foreground at `flush()`/`close()`; "never" syncs only at `close()`. The map is opened
with `writemap`: with "batch"/"never" an operating-system crash between syncs may damage the
environment. Every block is checksummed together with its key, so a damaged block reads as
a miss, never as wrong bytes; LMDB's own tree pages carry no checksum (damage there shows as
LMDB errors).

Modules, bottom up (each imports only those above it): `removals`, `layout`, `warm`,
`attach`, `env`, `scan`, `offline`, `tier` (`LMDBTier`; patch its tunables on
`tiercache.tiers.lmdb.tier`).
"""

from tiercache.tiers.lmdb.env import map_size_for
from tiercache.tiers.lmdb.layout import store_key
from tiercache.tiers.lmdb.offline import delete_entries, open_store
from tiercache.tiers.lmdb.tier import LMDBTier

__all__ = ["LMDBTier", "delete_entries", "map_size_for", "open_store", "store_key"]
