"""Block-level KV events from head shards' events (head shards: `tiercache.transfer.head_shards`).

With head shards the cache's events name shard keys, which mean nothing to a KV-aware
router. `ShardEvents` turns them back into events of the scheduler's block keys: a block is
stored in a medium once every one of its shards is (from any rank), and removed from it once
one of them leaves. Shard keys map back to block keys only for blocks the scheduler computed
keys of (`expect`, bounded, oldest first out); others (e.g. recovered at start-up) give no
events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tiercache.transfer.head_shards import HeadShards

EXPECT_MAX = 1 << 20  # shard keys remembered (16 + 16 bytes each, plus dict overhead)


class ShardEvents:
    """Block-level events of the blocks whose shard keys were `expect`ed (module docstring)."""

    def __init__(self, shards: HeadShards, cap: int = EXPECT_MAX) -> None:
        self._shards = shards
        self._cap = cap
        self._block: OrderedDict[bytes, bytes] = OrderedDict()  # shard key -> block key
        self._held: dict[bytes, dict[str, set[bytes]]] = {}  # block -> medium -> shard keys

    def expect(self, block_keys: Sequence[bytes]) -> None:
        """Remember the shard keys of `block_keys` (their events become block events)."""
        s = self._shards.shards
        skeys = self._shards.all_keys(block_keys)
        for i, b in enumerate(block_keys):
            for k in skeys[i * s : (i + 1) * s]:
                self._block[k] = b
                self._block.move_to_end(k)
        while len(self._block) > self._cap:
            _, b = self._block.popitem(last=False)
            self._held.pop(b, None)

    def apply(self, keys: Sequence[bytes], medium: str, removed: bool) -> list[bytes]:
        """Shard event (`keys` stored in or `removed` from `medium`) -> the block keys now
        stored there whole (stored) or no longer whole (removed), in order."""
        s = self._shards.shards
        out: list[bytes] = []
        for k in keys:
            b = self._block.get(k)
            if b is None:
                continue
            have = self._held.setdefault(b, {}).setdefault(medium, set())
            whole = len(have) == s
            if removed:
                have.discard(k)
                if whole and len(have) < s:
                    out.append(b)
                if not have:
                    del self._held[b][medium]
                    if not self._held[b]:
                        del self._held[b]
            else:
                have.add(k)
                if not whole and len(have) == s:
                    out.append(b)
        return list(dict.fromkeys(out))
