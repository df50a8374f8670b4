"""Block-level KV events from head shards' events (`tiercache.transfer.head_shards`).

With head shards the cache's events name shard keys, which mean nothing to a KV-aware router.
`ShardEvents` turns them back into events of block keys: a block is stored in a medium once
all its shards are (from any rank), and removed once one leaves. A shard maps back to its block
only once the scheduler computed the block's keys (`expect`); events of shards not mapped yet
(e.g. recovered at start-up) are kept and replayed then. Both maps are bounded, oldest first
out; a block forgotten while whole in a medium is announced removed (`take_forgotten`): a
router then misses a hit rather than routing where the block has gone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tiercache.transfer.head_shards import HeadShards

EXPECT_MAX = 1 << 20  # shard keys remembered, mapped and not (16 + 16 bytes each + overhead)


class ShardEvents:
    """Block-level events of head shards' events (module docstring)."""

    def __init__(self, shards: HeadShards, cap: int = EXPECT_MAX) -> None:
        self._shards = shards
        self._cap = cap
        self._block: dict[bytes, bytes] = {}  # shard key -> block key
        # block key -> its shard keys, oldest first: the bound and the order to forget in
        # are kept per block (a lookup touches each block once, not each of its shards)
        self._blocks: OrderedDict[bytes, tuple[bytes, ...]] = OrderedDict()
        self._held: dict[bytes, dict[str, set[bytes]]] = {}  # block -> medium -> shard keys
        self._unmapped: OrderedDict[bytes, set[str]] = OrderedDict()  # shard -> mediums
        self._forgotten: dict[str, list[bytes]] = {}  # medium -> blocks to announce removed

    def expect(
        self, block_keys: Sequence[bytes], shard_keys: Sequence[bytes] | None = None
    ) -> dict[str, list[bytes]]:
        """Map the shard keys of `block_keys` (`shard_keys`: their `HeadShards.all_keys`, if
        computed) back to them; the blocks this makes whole per medium (to announce stored)."""
        s = self._shards.shards
        blocks, new = self._blocks, []
        out: dict[str, list[bytes]] = {}
        for i, b in enumerate(block_keys):
            if b in blocks:
                blocks.move_to_end(b)
            else:
                new.append(i)
        if not new:
            return out
        if shard_keys is None:  # only the new blocks' keys are needed
            shard_keys = self._shards.all_keys([block_keys[i] for i in new])
            new_keys = [shard_keys[j * s : (j + 1) * s] for j in range(len(new))]
        else:
            new_keys = [shard_keys[i * s : (i + 1) * s] for i in new]
        unmapped = self._unmapped
        for i, keys in zip(new, new_keys, strict=True):
            b = block_keys[i]
            if b in blocks:  # twice in `block_keys`
                continue
            blocks[b] = tuple(keys)
            for k in keys:
                self._block[k] = b
                for medium in unmapped.pop(k, ()) if unmapped else ():
                    if self._add(b, k, medium):
                        out.setdefault(medium, []).append(b)
        while len(blocks) * s > self._cap:
            b, keys = blocks.popitem(last=False)
            self._forget(b, keys)
        return out

    def take_forgotten(self) -> dict[str, list[bytes]]:
        """Blocks forgotten past the bound while whole in a medium, per medium, each once:
        to announce as removed."""
        out, self._forgotten = self._forgotten, {}
        return out

    def _forget(self, block: bytes, keys: tuple[bytes, ...]) -> None:
        for k in keys:
            self._block.pop(k, None)
        for medium, have in self._held.pop(block, {}).items():
            if len(have) == self._shards.shards:
                self._forgotten.setdefault(medium, []).append(block)

    def apply(self, keys: Sequence[bytes], medium: str, removed: bool) -> list[bytes]:
        """Shard event (`keys` stored in or `removed` from `medium`) -> the block keys now
        stored there whole (stored) or no longer whole (removed), in order."""
        out: list[bytes] = []
        for k in keys:
            b = self._block.get(k)
            if b is None:
                self._note_unmapped(k, medium, removed)
            elif removed:
                out.extend(self._remove(b, k, medium))
            else:
                out.extend(self._add(b, k, medium))
        return list(dict.fromkeys(out))

    def _add(self, block: bytes, key: bytes, medium: str) -> list[bytes]:
        have = self._held.setdefault(block, {}).setdefault(medium, set())
        was = len(have)
        have.add(key)
        return [block] if was < self._shards.shards == len(have) else []

    def _remove(self, block: bytes, key: bytes, medium: str) -> list[bytes]:
        by_medium = self._held.get(block, {})
        have = by_medium.get(medium)
        if not have or key not in have:
            return []
        whole = len(have) == self._shards.shards
        have.discard(key)
        if not have:
            del by_medium[medium]
            if not by_medium:
                del self._held[block]
        return [block] if whole else []

    def _note_unmapped(self, key: bytes, medium: str, removed: bool) -> None:
        mediums = self._unmapped.get(key)
        if removed:
            if mediums is not None:
                mediums.discard(medium)
                if not mediums:
                    del self._unmapped[key]
            return
        if mediums is None:
            mediums = self._unmapped[key] = set()
        mediums.add(medium)
        self._unmapped.move_to_end(key)
        while len(self._unmapped) > self._cap:
            self._unmapped.popitem(last=False)
