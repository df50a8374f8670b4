"""`LMDBTier`: blocks in an embedded LMDB environment, shareable between processes.

Primitives (on top of the `Tier` ABC):
- `write(slots, src, keys)`: one batched write transaction per call (split only when a call
  exceeds `txn_ops_for`, see `map_size_for`); zstd (2-byte-plane shuffle) compression runs
  before the transaction, on a thread pool, and is kept only when it pays.
- `read(slots, dst, keys)`: one read transaction, zero-copy `buffers=True` gets, header and
  key checks, checksum verified on every block; a missing or bad block is a failed position.
- `free(slots)`: the base free list; a block this tier stored since it opened is also
  deleted in the next write transaction or at `flush()` (a demotion planned with the
  eviction reads it first); blocks found at open or adopted are only forgotten.
- `take_gone(keys)`: which failed reads were plain misses (the store evicted the block).
- `take_evicted()`: the blocks this tier's own write transactions evicted by the store's
  capacity, by key: the manager drops them from its index and reports them removed.
- `recover()`: (key, slot) of every stored block, oldest first by the header's write seq.
- `flush()`, `close()`, `stats()`.

Layout. Databases "meta" (JSON: store format, version, block_bytes), "heads" (store key ->
the 64-byte `tiers.format` header) and "blocks" (store key -> stored payload), header and
payload put
in the same write transaction. Not one header+payload value: py-lmdb has no MDB_RESERVE, so
a joined value costs a 2 MiB staging copy per block; with two values the payload goes from
the caller's tensor straight into the map (2 MiB blocks, batches of 32, same run: 0.64 vs
0.82 of raw py-lmdb put throughput), and the open-time scan reads only header pages, never
payloads. The checksum still covers header and payload together.

The store key is the 8-byte namespace id (big-endian, as `tiers.format.namespace_id` gives
it) followed by the 16-byte block key (`store_key`): tenants with different namespaces hold
equal block keys side by side, a tier reads, counts, scans and deletes only keys under its
own namespace's prefix, and never touches another's. (Version 1 stores keyed by the block
key alone are refused at open, with the format-version error.)

Slots are logical handles: LMDB addresses blocks by key; the tier keeps a slot -> key map
only so that `free` knows which key to delete. A read goes by key.

Version 3 adds the "order" database (namespace prefix + order seq -> block key) and the
8-byte order seq after each header in "heads"; "meta" keeps each namespace's block count and
the environment's next seq. All change in the write transactions that change the blocks
(`StoreTxn`), so capacity and eviction belong to the store: every transaction that stores
evicts its namespace's oldest blocks beyond the capacity, whichever process runs it. The
process that runs it reports them (`take_evicted`); every other process finds them gone.

Each tier also records its namespace's capacity and name and an attach entry (pid, host,
opened at) in "meta" at open, deleting the entry at close (`attach`): what
`tiercache inspect` shows. A store without these records reads as "not recorded".

Opening deletes no good block: a tier indexes the newest `capacity` blocks of its namespace
from the order entries (headers only); only malformed entries under its own prefix are
dropped at open. A well-formed namespace is scanned in bulk (`scan.scan_fast`: two cursor runs
over its "order" and "heads" entries into arrays, checked as arrays, no payload looked at:
a read verifies it); any malformed entry sends the open to the entry-by-entry walk, which
finds and drops exactly those.

Readahead. The map is opened with `readahead=False` (MADV_RANDOM on the map). With the
kernel's readahead on, a page fault in the map read a whole window around the faulting page
(`read_ahead_kb`: 8 MiB on the machine of issue 35) into large page-cache folios. The cost
was threefold. (1) Fills slowed as the store grew: a write through the map dirties the whole
folio that holds the page, so each background sync wrote back nearly the whole file (1M
blocks of 4 KiB, issue 35: 50.7 GB written by the process for a 0.8 GB store, the last 100k
blocks 12.5 GB; with readahead off 7.7 GB, 0.7-0.9 GB per 100k blocks at every size).
(2) An open read 776 bytes per block from disk for 100k blocks instead of 202 (payload
pages came in with the header leaves). (3) A cold lookup read megabytes around each leaf.
Off, a fault reads its page alone; what wants more asks for it: `read` advises the kernel
of each multi-page payload before copying it (`warm.will_need`), and a lazy open warms
the "heads" and "order" pages in the background (`warm.warm_index`, never payloads),
so the first lookup of each key finds its index pages in the page cache.

Sharing. One `lmdb.Environment` per real path per process, reference counted (LMDB refuses a
second open of an environment in one process). Any number of processes may open and write
the same directory: LMDB's writer mutex serializes the write transactions and readers never
block. A process sees blocks another stored through `probe` on a lookup miss; a block another
process evicted reads as a plain miss (`take_gone`). A process that does not hold the store
as a tier (vLLM's scheduler) asks it through `LMDBProbe`: headers only, read-only.

Durability (`sync`): "always" opens the environment with sync and metasync (a write is
durable when it returns); "batch" commits without fsync, starts a background `env.sync`
after a commit at most every `sync_interval` seconds (default `SYNC_EVERY_S`, 5; writers do
not wait for it) and syncs in the foreground at `flush()`/`close()`; "never" syncs only at
`close()`. A sync writes back every map page written since the last one, so a longer
interval costs puts less on a large store and lets an OS crash lose more. The map is
opened with `writemap` (puts write the map in place): with "batch"/"never" an
operating-system crash between syncs may damage the environment. Every block is
checksummed together with its key, so a damaged block reads as a miss, never as wrong
bytes; LMDB's own tree pages carry no checksum (damage there shows as LMDB errors).

Modules, bottom up (each imports only those above it):
- `layout`: constants, the key layout, the store-level write transaction (`StoreTxn`).
- `warm`: the index warm pass and `will_need` (no package imports).
- `attach`: the capacity, name and attach records in "meta" (no package imports).
- `env`: map size, thread pools, the directory, the shared environment (attach/detach),
  open, reservation and metadata.
- `scan`: what an open indexes (lazy, bulk, entry by entry).
- `offline`: `open_store`/`StoreHandle`, `LMDBProbe`, offline iteration and deletes,
  `open_here` (whether this process holds a store open).
- `tier`: `LMDBTier`, and the tunables of its write path (`SYNC_EVERY_S`, `MAP_FULL_TRIES`:
  patch them on `tiercache.tiers.lmdb.tier`).

This module exports the tier and the offline names tools use (`open_store`, `delete_entries`,
`store_key`, `map_size_for`); everything else is imported from the module that defines it.
"""

from tiercache.tiers.lmdb.env import map_size_for
from tiercache.tiers.lmdb.layout import store_key
from tiercache.tiers.lmdb.offline import delete_entries, open_store
from tiercache.tiers.lmdb.tier import LMDBTier

__all__ = ["LMDBTier", "delete_entries", "map_size_for", "open_store", "store_key"]
