"""vLLM KV events for tiercache's blocks, self-describing (issue 51; docs/events.md).

A router (llm-d's precise prefix scorer, Dynamo) matches a request's tokens against the blocks
each engine reports, by vLLM's own block hashes. tiercache keys its blocks by its own
deterministic hashes, so the scheduler role describes each block in vLLM's terms while the
request is in hand and reports it with that description:

- `BlockDescriptor`: one loadable unit (a tiercache block) as vLLM's prefix cache would
  report it: its vLLM block hashes (one per vLLM hash block; a tiercache block larger than
  vLLM's hash block carries several, reported and removed together, never a part), the
  parent's vLLM hash, the token ids, vLLM's block size, LoRA, and the extra keys (cache salt,
  multimodal hashes) in the untagged form vLLM's events use. `describe(request, position)`
  builds it from a vLLM `Request`.
- `Placement`: tier name -> (vLLM medium, locality): "CPU" for host memory, "GPU" for a GPU
  tier, "STORAGE" for disks and stores; locality "LOCAL" for a tier only this engine reads,
  `SHARED` for a store every engine attached to it reads (and reports).
- `EventTranslator`: tiercache's (keys, tier, removed) events -> `BlockStored` /
  `BlockRemoved`, one `BlockStored` per unit, per (medium, locality): a block held in two
  tiers of one medium and locality is reported once, and removed when it leaves the last.
  A block with no description is not reported; it is once described (a lookup hit on it, a
  store of it). Descriptions are kept while the block is held somewhere, and at most
  `limit` more held nowhere (not stored yet, or just evicted: a demotion reports the block
  removed from one tier before stored in the next). Also `snapshot` and `rotate`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from tiercache.config import CacheConfig

__all__ = [
    "LOCAL",
    "SHARED",
    "BlockDescriptor",
    "EventTranslator",
    "Placement",
    "describe",
    "placement_of",
]

# Locality words. vLLM's own: LOCAL (and REMOTE, which consumers such as Dynamo refuse to
# load). tiercache's: SHARED, a store every engine attached to it can load from; each such
# engine reports the block. A consumer that ignores locality sees a STORAGE block.
LOCAL, SHARED = "LOCAL", "SHARED"
_MEDIUM = {"cpu": "CPU", "gpu": "GPU"}  # every other kind: "STORAGE"
_SHARED_KINDS = frozenset({"lmdb", "redis"})


@dataclass(frozen=True, slots=True)
class BlockDescriptor:
    """One loadable block in vLLM's terms (see the module doc)."""

    hashes: tuple[bytes, ...]  # vLLM's BlockHash (raw), one per vLLM hash block
    parent: bytes | None
    token_ids: tuple[int, ...]
    block_size: int  # tokens per vLLM hash
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None  # untagged, as events carry
    # For another engine recomputing the hashes with its own hash function (shared_blocks):
    # the parent's tiercache key and the tagged extra keys vLLM hashes, per vLLM hash block.
    parent_key: bytes | None = None
    tagged: tuple[tuple[Any, ...] | None, ...] | None = None

    def external(self) -> list[Any]:
        """The hashes as vLLM's events publish them (64-bit ints unless configured not to)."""
        return [maybe_convert_block_hash(h) for h in self.hashes]

    def stored(self, medium: str, locality: str) -> BlockStored:
        return BlockStored(
            block_hashes=self.external(),
            parent_block_hash=(
                maybe_convert_block_hash(self.parent) if self.parent is not None else None
            ),
            token_ids=list(self.token_ids),
            block_size=self.block_size,
            lora_id=self.lora_id,
            medium=medium,
            lora_name=self.lora_name,
            extra_keys=list(self.extra_keys) if self.extra_keys is not None else None,
            locality=locality,
        )


def describe(
    request: Request, position: int, tokens_per_block: int, parent_key: bytes | None = None
) -> BlockDescriptor | None:
    """The `position`-th tiercache block of `request` (`tokens_per_block` tokens; the block
    before it keyed `parent_key`), or None when vLLM has not hashed all of it."""
    hashes = getattr(request, "block_hashes", None) or []
    tokens = request.all_token_ids
    full = len(tokens) // tokens_per_block
    if not hashes or full == 0:
        return None
    per = max(1, len(hashes) // full)  # vLLM hashes per tiercache block
    first, end = position * per, (position + 1) * per
    if end > len(hashes) or (position + 1) * tokens_per_block > len(tokens):
        return None
    hbs = tokens_per_block // per
    lora = getattr(request, "lora_request", None)
    extra = tagged = None
    if lora is not None or getattr(request, "mm_features", None) or request.cache_salt:
        keys = [
            generate_block_hash_extra_keys(request, s, s + hbs, 0)[0]
            for s in range(first * hbs, end * hbs, hbs)
        ]
        if any(k is not None for k in keys):
            tagged = tuple(keys)
            ek = to_event_extra_keys(keys)
            extra = tuple(ek) if ek is not None else None
    return BlockDescriptor(
        hashes=tuple(bytes(h) for h in hashes[first:end]),
        parent=bytes(hashes[first - 1]) if first > 0 else None,
        token_ids=tuple(tokens[position * tokens_per_block : (position + 1) * tokens_per_block]),
        block_size=hbs,
        lora_id=getattr(lora, "adapter_id", None) if lora is not None else None,
        lora_name=getattr(lora, "name", None) if lora is not None else None,
        extra_keys=extra,
        parent_key=parent_key if position > 0 else None,
        tagged=tagged,
    )


Placement = Mapping[str, tuple[str, str]]  # tier name -> (vLLM medium, locality)


def placement_of(config: CacheConfig) -> dict[str, tuple[str, str]]:
    """Each tier's vLLM medium and locality, by the tier's name (the event medium)."""
    return {
        t.name: (_MEDIUM.get(t.kind, "STORAGE"), SHARED if t.kind in _SHARED_KINDS else LOCAL)
        for t in config.tiers
    }


class EventTranslator:
    """tiercache events -> vLLM's self-describing events (see the module doc)."""

    def __init__(
        self,
        placement: Placement,
        limit: int = 65536,
        on_shared: Callable[[bytes, str, BlockDescriptor], None] | None = None,
    ) -> None:
        """`on_shared(key, tier, desc)`: a described block is held in a SHARED tier (told
        once per key and tier: `shared_blocks` writes its description beside it)."""
        self._placement = dict(placement)
        self._on_shared = on_shared
        self._limit = limit
        self._desc: dict[bytes, BlockDescriptor] = {}
        self._held: dict[bytes, set[str]] = {}  # key -> tiers holding it
        # tier -> its keys, least recently rotated first (new keys join at the back)
        self._ring: dict[str, OrderedDict[bytes, None]] = {}
        self._unheld: OrderedDict[bytes, None] = OrderedDict()  # described, held nowhere
        self._out: list[KVCacheEvent] = []

    def _shared(self, key: bytes, tiers: Iterable[str], desc: BlockDescriptor) -> None:
        if self._on_shared is not None:
            for t in tiers:
                if self._where(t)[1] == SHARED:
                    self._on_shared(key, t, desc)

    def _where(self, tier: str) -> tuple[str, str]:
        return self._placement.get(tier, ("STORAGE", LOCAL))

    def _classes(self, tiers: Iterable[str]) -> set[tuple[str, str]]:
        return {self._where(t) for t in tiers}

    def described(self, key: bytes) -> bool:
        return key in self._desc

    def record(self, key: bytes, desc: BlockDescriptor) -> None:
        """Describe `key`; if it is held already, report it now where it is held."""
        if key in self._desc:
            return
        self._desc[key] = desc
        tiers = self._held.get(key)
        if tiers:
            for medium, locality in sorted(self._classes(tiers)):
                self._out.append(desc.stored(medium, locality))
            self._shared(key, tiers, desc)
            return
        self._keep(key)

    def _keep(self, key: bytes) -> None:
        """Keep `key`'s description while it is held nowhere, among the newest `limit`."""
        self._unheld[key] = None
        self._unheld.move_to_end(key)
        while len(self._unheld) > self._limit:
            old, _ = self._unheld.popitem(last=False)
            self._desc.pop(old, None)

    def apply(self, keys: Iterable[bytes], tier: str, removed: bool) -> None:
        """`keys` were stored into (or removed from) tier `tier`."""
        cls = self._where(tier)
        ring = self._ring.setdefault(tier, OrderedDict())
        gone: list[Any] = []
        for k in keys:
            tiers = self._held.get(k)
            if not removed:
                if tiers is None:
                    tiers = self._held[k] = set()
                    self._unheld.pop(k, None)
                new = not tiers or cls not in self._classes(tiers)
                fresh = tier not in tiers
                tiers.add(tier)
                if fresh:  # a key stored again keeps its place: it never starves the rotation
                    ring[k] = None
                d = self._desc.get(k)
                if new and d is not None:
                    self._out.append(d.stored(*cls))
                if fresh and d is not None:
                    self._shared(k, (tier,), d)
                continue
            if tiers is None or tier not in tiers:
                continue
            tiers.discard(tier)
            del ring[k]
            d = self._desc.get(k)
            if d is not None and cls not in self._classes(tiers):
                gone.extend(d.external())
            if not tiers:  # kept a while: a demotion's store into the next tier follows
                del self._held[k]
                if d is not None:
                    self._keep(k)
        if gone:
            self._out.append(BlockRemoved(block_hashes=gone, medium=cls[0], locality=cls[1]))

    def holds(self, key: bytes, tier: str) -> bool:
        return tier in self._held.get(key, ())

    def held_in(self, tier: str) -> list[bytes]:
        """Keys this translator has as held in `tier` (all of them: O(held))."""
        return list(self._ring.get(tier, ()))

    def rotate(self, tier: str, n: int) -> list[bytes]:
        """The next `n` keys held in `tier` (all of them when fewer), round robin: the keys
        held longest without a turn first, each sent to the back. A key held while the tier
        holds `held` keys is returned within the next ceil(held / n) calls, whatever is stored
        or removed in between (new keys join behind it, removals only move it up). O(n): a
        step of the shared stores' sweep never walks the whole tier."""
        ring = self._ring.get(tier)
        if not ring:
            return []
        out = list(itertools.islice(ring, min(n, len(ring))))
        for k in out:
            ring.move_to_end(k)
        return out

    def describes(self, key: bytes) -> BlockDescriptor | None:
        return self._desc.get(key)

    def take(self) -> list[KVCacheEvent]:
        out, self._out = self._out, []
        return out

    def snapshot(self) -> list[KVCacheEvent]:
        """A `BlockStored` for every held, described block, per medium and locality (for a
        subscriber that rebuilds its view)."""
        return [
            d.stored(medium, locality)
            for k, tiers in self._held.items()
            if (d := self._desc.get(k)) is not None
            for medium, locality in sorted(self._classes(tiers))
        ]
