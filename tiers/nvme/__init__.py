"""`NVMeTier`: blocks in one preallocated slab file, one O_DIRECT-aligned slot per block, and a
checksummed append-only index journal that says which key lives in which slot.

Layout under `path` (a private directory, 0700; every file 0600):
- `meta.json`: format tag and version, block_bytes, capacity_blocks, slot_bytes (JSON, never
  pickle; written to `meta.json.tmp`, fsynced, renamed).
- `slab`: `capacity_blocks * slot_bytes` bytes, preallocated (posix_fallocate), plus the slots
  of blocks it keeps for other namespaces (see Tenants). Slot i starts at `i * slot_bytes`
  and holds a `tiers.format` record: the 64-byte header (key, namespace id, length, write
  sequence, xxh3 checksum over header and payload), the raw payload, zero padding.
  `slot_bytes` = HEADER_SIZE + block_bytes rounded up to 4096, so every slot offset and
  length is O_DIRECT aligned. A read or write moves each run of adjacent slots it names with
  one syscall (up to `RUN_BYTES`), then checks every slot alone.
- `index`: the journal. Fixed 40-byte records `(magic, version, op, slot, seq, key, xxh3)` with
  op PUT (key now lives in slot), FREE (slot emptied) or BASE (the sequence counter so far).
  On open every record is checked alone (a flipped byte loses one record, a torn tail loses
  the tail); per slot the record with the highest seq wins; each surviving PUT is checked
  against its slot's header (key, seq, length) before it is recovered. The journal is then
  rewritten compactly (BASE + live PUTs), and again on close and whenever it grows past
  `2 * capacity + COMPACT_SLACK` records.
- `index.img`: the index image, written with every compaction (tmp, fsync, renamed after the
  journal): the live and kept entries as fixed-width arrays (slot, seq, namespace, key), the
  journal bytes it covers with their xxh3, and the namespace of the tier that appends after
  it; checksummed as a whole. An open loads it and replays only the journal records after
  it, reading no slot (a read verifies key, namespace, seq and checksum); a missing, damaged
  or stale image falls back to the full replay with header checks above.

Crash ordering: a store writes the data of all its slots, then (fsync="always") fdatasyncs the
slab, and only then appends its PUT records (and fdatasyncs the journal). A crash before the
records land leaves slots the index does not name; a record whose data never landed, or was
torn, names a slot whose header does not match (dropped at open) or whose payload fails the
checksum (a failed position on read). No path serves bytes under a key they were not written
for.

fsync modes: "always" = durable when `write` returns; "batch" = slab then journal are
fdatasynced at `flush()`/`close()`, after every BATCH_SYNC_BYTES bytes of slots written, and
at most BATCH_SYNC_SECONDS after an unsynced write (a timer); "never" = no fsync at all, not
even at `flush()` (a power loss may lose the whole index).

Instances. One process per directory (an exclusive flock, taken at open). With `instances =
N` a tier whose `path` is held by another live process takes the first free of
`path/instance1` .. `path/instance{N-1}` (instance 0 is `path` itself); with `instance = k`
it opens instance k and nothing else (a data-parallel rank), and with `instance_env = "VAR"`
the instance that environment variable names. Locks die with their process, so a restarted
replica takes a free instance back, with its blocks.

Tenants. Processes with different namespaces may use one directory one after the other
(flock: never at once). Opening deletes nothing: blocks stamped with another namespace, and
blocks of ours beyond `capacity` (the oldest, when reopened smaller), are *kept*: not served
(a read checks the header's namespace as well as its key), not counted in `used_blocks`,
never handed out as free slots, never evicted, and carried over by every journal rewrite.
This tier's `capacity` slots are the other ones; the slab holds both, so it grows past
`capacity * slot_bytes` while it keeps blocks (reserved at open like any slot). Equal keys
of two namespaces live in two slots. Dropping another namespace's blocks is an operator's
decision (`tiercache evict/clear --namespace`). The slab shrinks only by slots that hold
nothing.

Modules, each importing only those before it: `journal`, `image`, `options`, `layout`, `io`,
`recovery`, `index_open`, `slot_reads`, `slot_writes`, `reader` (offline access for the CLI),
`tier` (`NVMeTier`; patch its tunables on `tiercache.tiers.nvme.tier`).
"""

from tiercache.tiers.nvme.io import ALIGN
from tiercache.tiers.nvme.layout import instance_dirs, read_meta
from tiercache.tiers.nvme.reader import NVMeStoreReader
from tiercache.tiers.nvme.tier import NVMeTier

__all__ = ["ALIGN", "NVMeStoreReader", "NVMeTier", "instance_dirs", "read_meta"]
