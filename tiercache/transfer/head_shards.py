"""Head shards: one block layout for every tensor-parallel size (docs/tp-layout.md).

A block is stored as `shards` head shards of ``H/shards`` consecutive KV heads each, every
layer, K and V; rank `r` of `n` (``shards % n == 0``) owns shards ``[r*shards/n,
(r+1)*shards/n)`` and writes and reads exactly those: no byte is stored twice, no rank reads
another's bytes, and a TP=1 engine reads what a TP=2 engine stored.

Primitives:
- `HeadShards(shards, tp_size, tp_rank)`: which shards a rank owns (`owned`, `local`), and the
  mapping the connector uses at its edge: block keys -> this rank's shard keys (`keys`), or
  every rank's (`all_keys`: "a hit needs every shard"), engine block ids -> shard units
  (`units`) and back (`blocks`).
- `HeadShards.unit_views(kv_caches, num_blocks, heads)`: the engine buffer as `num_blocks *
  local` units of one shard each, views of the same memory, which `KVLayout` copies like
  blocks. A unit's bytes are equal on every TP size.
- `default_shards(total_heads)`: the largest power of two dividing the KV-head count, at most
  8: the largest TP size the store serves by default.

The engine's layout must keep a block's heads outermost and contiguous (vLLM's ``LBHNC``: per
layer ``[num_blocks, heads, tokens, 2*head]``, or K/V first ``[2, num_blocks, heads, tokens,
head]``); `unit_views` refuses other shapes with a ValueError and checks the head count it is
given (shapes alone cannot tell heads from tokens when a block has as many tokens as the rank
has heads: the connector uses head shards only where vLLM names the layout ``LBHNC``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from tiercache.errors import check_count
from tiercache.hashing import shard_keys

MAX_DEFAULT_SHARDS = 8


def default_shards(total_heads: int) -> int:
    """The largest power of two dividing `total_heads`, at most `MAX_DEFAULT_SHARDS`."""
    check_count("total_heads", total_heads)
    s = 1
    while s < MAX_DEFAULT_SHARDS and total_heads % (2 * s) == 0:
        s *= 2
    return s


@dataclass(frozen=True)
class HeadShards:
    """The head shards of a store (`shards` per block) and the ones TP rank `tp_rank` of
    `tp_size` owns. ValueError unless `tp_size` divides `shards`."""

    shards: int
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("shards", "tp_size"):
            check_count(name, getattr(self, name))
        if self.shards % self.tp_size:
            raise ValueError(
                f"a store of {self.shards} head shards per block serves TP sizes dividing "
                f"{self.shards}, not {self.tp_size}"
            )
        r = self.tp_rank
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.tp_size:
            raise ValueError(f"tp_rank: expected 0 <= tp_rank < {self.tp_size}, got {self.tp_rank}")

    @property
    def local(self) -> int:
        """Shards per block this rank owns."""
        return self.shards // self.tp_size

    @property
    def owned(self) -> range:
        """The shard indices this rank owns."""
        return range(self.tp_rank * self.local, (self.tp_rank + 1) * self.local)

    def keys(self, block_keys: Sequence[bytes]) -> list[bytes]:
        """This rank's shard keys of `block_keys`, block-major (`local` per block)."""
        return shard_keys(block_keys, self.owned)

    def all_keys(self, block_keys: Sequence[bytes]) -> list[bytes]:
        """Every rank's shard keys of `block_keys`, block-major (`shards` per block)."""
        return shard_keys(block_keys, range(self.shards))

    def owner(self, position: int) -> int:
        """The TP rank that owns the shard at `position` of an `all_keys` list."""
        return (position % self.shards) // self.local

    def units(self, block_ids: Iterable[int]) -> list[int]:
        """The shard units of engine blocks `block_ids`, in the order of `keys`."""
        s = self.local
        return [b * s + j for b in block_ids for j in range(s)]

    def blocks(self, unit_ids: Iterable[int]) -> set[int]:
        """The engine blocks of shard units `unit_ids`."""
        s = self.local
        return {u // s for u in unit_ids}

    def whole(self, n: int, per_block: int | None = None) -> int:
        """`n` shard keys rounded down to whole blocks of `per_block` keys (default `local`,
        this rank's; the scheduler, which looks up every rank's, gives `shards`): a block is
        there only with every one of its shards."""
        s = self.local if per_block is None else per_block
        check_count("per_block", s)  # `local` when not given: always one
        return n - n % s

    def unit_views(
        self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int, heads: int
    ) -> dict[str, torch.Tensor]:
        """Each layer's tensor as `num_blocks * local` units (see the module docstring);
        views of the same memory. `heads` is this rank's KV heads. ValueError naming the
        layer when its layout does not keep a block's `heads` heads outermost and contiguous,
        or its shape reads both as ``[num_blocks, heads, ...]`` and as
        ``[2, num_blocks, heads, ...]``."""
        check_count("heads", heads)
        s = self.local
        out: dict[str, torch.Tensor] = {}
        for name, t in kv_caches.items():
            shape, stride = list(t.shape), list(t.stride())
            kv = len(shape) >= 4 and shape[0] == 2 and shape[1] == num_blocks and shape[2] == heads
            first = len(shape) >= 3 and shape[0] == num_blocks and shape[1] == heads
            if kv and first:
                raise ValueError(
                    f"kv_caches[{name!r}]: shape {tuple(shape)} is ambiguous with "
                    f"num_blocks={num_blocks} and {heads} heads (blocks first, or K/V first)"
                )
            if not (kv or first):
                raise ValueError(
                    f"kv_caches[{name!r}]: shape {tuple(shape)} is not [num_blocks, heads, ...] "
                    f"or [2, num_blocks, heads, ...] with num_blocks={num_blocks}, heads={heads}"
                )
            b = 1 if kv else 0  # the block dim; the head dim follows it
            page = t[0, 0] if kv else t[0]
            if heads % s or not page.is_contiguous() or stride[b] != heads * stride[b + 1]:
                raise ValueError(
                    f"kv_caches[{name!r}]: shape {tuple(shape)}, strides {tuple(stride)}: a "
                    f"block's {heads} KV heads are not outermost and contiguous in {s} equal "
                    "shards; head shards need vLLM's LBHNC layout"
                )
            g = heads // s
            shape[b : b + 2] = [num_blocks * s, g]
            stride[b : b + 2] = [g * stride[b + 1], stride[b + 1]]
            out[name] = t.as_strided(shape, stride, t.storage_offset())
        return out
