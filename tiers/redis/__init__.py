"""`RedisTier`: blocks in Redis (or Valkey), single node or Redis Cluster, shared by a fleet.

Primitives (on top of the `Tier` ABC):
- `write(slots, src, keys)`: one pipelined batch of SETs per call (split only past
  `PIPELINE_BYTES`), pending deletes riding in the same pipeline.
- `read(slots, dst, keys)`: one pipelined batch of GETs (GETEX when a `ttl` is set, so reads
  keep hot blocks alive), every block verified. A missing key or a corrupt or foreign value
  is a failed position: a miss, counted, never an error.
- `free(slots)`: for blocks this instance stored since it opened, a DEL sent with the next
  write or at `flush()`; blocks found at open or adopted are only forgotten.
- `take_gone(keys)`, `recover()` (SCAN + a pipelined GETRANGE of each header at open, the
  newest `capacity`), `available`, `stats()`, `flush()`, `close()`.

Key = `prefix` + namespace (utf-8) + the 16-byte block key. Value = the `tiers.format` record,
header then stored payload in one string (the checksum covers both). `prefix + namespace +
"#meta"` holds JSON (format, version, block_bytes): a reopen with another block size is
refused.

Sharing. Capacity of the store belongs to the server: `maxmemory` with an LRU (or LFU) policy
evicts what no instance reads, since every instance's GET refreshes a key's recency
(docs/redis.md says why not a shared index). Evicting deletes only a block this instance
stored since it opened, so no instance deletes another's blocks; a block another instance
deleted, or the server evicted or expired, reads as a plain miss (`take_gone`). Two instances
storing one block write identical bytes; SET is atomic, so a reader sees one whole record.

Failures. Every socket operation has a bounded timeout. A connection error or timeout marks
the tier unavailable: calls during the back-off (0.1 s doubling up to `backoff_max`) raise
OSError at once without touching the network; the first call after it tries the server
again. A key whose read failed only because Redis was unreachable is not deleted when the
cache drops it: the stored block is fine. Credentials are never logged.

Files: `client.py` (URLs, credentials, the client, the packed pipeline; the CLI's `inspect`
uses it too), `tier.py` (`RedisTier`); tunables are patched where they live
(`tier.BACKOFF_START_S`, `tier.PIPELINE_BYTES`, `client.SEND_INLINE_MAX`).
"""

from __future__ import annotations

from tiercache.tiers.redis.tier import RedisTier

__all__ = ["RedisTier"]
