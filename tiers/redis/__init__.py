"""`RedisTier`: blocks in Redis (or Valkey), single node or Redis Cluster, shared by a fleet.

Primitives (on top of the `Tier` ABC):
- `write(slots, src, keys)`: one pipelined batch of SETs per call (split only past
  `PIPELINE_BYTES`), pending deletes riding in the same pipeline; never a round trip per block.
- `read(slots, dst, keys)`: one pipelined batch of GETs (GETEX when a `ttl` is set, so reads
  keep hot blocks alive); header, key, namespace and checksum verified on every block. A
  missing key (expired, evicted by Redis's maxmemory policy, deleted by another instance) or
  a corrupt or foreign value is a failed position: a miss, counted, never an error.
- `free(slots)`: the base free list plus, for blocks this instance stored since it opened, a
  pending DEL sent with the next write or at `flush()` (a demotion planned with the eviction
  reads them first). Blocks found at open or adopted are only forgotten.
- `take_gone(keys)`: which failed reads were plain misses (no value under the key).
- `recover()`: blocks of this namespace already in Redis when the tier opened (SCAN + a
  pipelined GETRANGE of each 64-byte header), newest `capacity` of them, oldest first.
- `available`, `stats()`, `flush()`, `close()`.

Key = `prefix` + namespace (utf-8) + the 16-byte block key. Value = the `tiers.format` record,
header then stored payload in one string (the checksum covers both). A store-level key
`prefix + namespace + "#meta"` holds JSON (format, version, block_bytes): a reopen with
another block size is refused, like the other persistent tiers.

Sharing. The manager's index learns what the store holds when the tier opens (`recover`)
and, on a lookup miss, what other instances stored since (`probe`, `adopt`). Capacity of
the store belongs to the server: `maxmemory` with an LRU (or LFU) policy bounds it and evicts
what no instance reads, since every instance's GET refreshes a key's recency on the server
(docs/redis.md says why not a shared index). The tier's `blocks` is this instance's index:
its policy decides what it remembers; evicting deletes (DEL) only a block this instance
stored since it opened, never one it found at open or adopted, so no instance deletes
another's blocks. A block another instance deleted, or the server evicted or expired,
reads as a plain miss (`take_gone`), never a counted error. Two instances storing one block
at once write identical bytes; SET is atomic, so a reader sees one whole record or none.

Failures. Every socket operation has a bounded timeout (`timeout`). A connection error or
timeout marks the tier unavailable: calls during the backoff window (0.1 s doubling up to
`backoff_max`) raise OSError at once without touching the network (the cache serves from
its other tiers and counts the error); the first call after the window probes the server,
and a success marks it available again (counted in `reconnects`). A key whose read failed
only because Redis was unreachable is not deleted when the cache drops it from its index:
the stored block is fine and other instances may use it. Credentials are never logged: the
URL is shown without its password, error messages carry no secret.

Files: `client.py` (public: URLs, credentials, the client, the packed pipeline; the CLI's
`inspect` uses it too), `tier.py` (`RedisTier`, the one name exported here); tunables are
patched where they live (`tier.BACKOFF_START_S`, `tier.PIPELINE_BYTES`, `client.SEND_INLINE_MAX`).
"""

from __future__ import annotations

from tiercache.tiers.redis.tier import RedisTier

__all__ = ["RedisTier"]
