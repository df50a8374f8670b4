"""vLLM's KV cache groups (hybrid KV cache manager) as tiercache serves them.

Primitives: `kv_groups(kv_cache_config) -> tuple[KVGroup, ...]` (non-attention groups are
refused), `groups_tag(groups)` (the layout's name for them), `window_positions(group, start,
end)` (which blocks of a group a hit loads) and `hit_end(groups, start, full_end, has)` (the
longest hit every group can serve).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# vLLM KV cache spec classes served as attention: full attention (and MLA, a subclass), and
# sliding windows. Names, not classes: this module imports no vLLM.
_FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
_WINDOW_SPECS = frozenset({"SlidingWindowSpec"})


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group as tiercache serves it. `name` goes into the group keys
    (`tiercache.hashing.group_keys`; "" for one group: the plain prefix keys). `window_blocks`
    is 0 for full attention; for a sliding window, how many blocks before a hit's end its
    layers read (what vLLM's sliding-window manager keeps)."""

    index: int
    name: str
    kind: str  # "full_attention" | "sliding_window"
    layers: tuple[str, ...]
    window_blocks: int
    block_bytes: int


def kv_groups(kv_cache_config: Any, who: str = "TierCacheConnector") -> tuple[KVGroup, ...]:
    """vLLM's `KVCacheConfig.kv_cache_groups` as `KVGroup`s (read by attribute). ValueError
    naming the group and its spec for what tiercache cannot serve right: non-attention state
    (Mamba, linear attention: one state per request, not per block of tokens), other
    attention kinds, and groups whose block sizes or bytes per block differ. `who` names the
    adapter."""
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ValueError("kv_cache_config: no KV cache groups")
    out: list[KVGroup] = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind_name = type(spec).__name__
        layers = tuple(str(n) for n in g.layer_names)
        if kind_name in _FULL_SPECS:
            kind, window = "full_attention", 0
        elif kind_name in _WINDOW_SPECS:
            kind = "sliding_window"
            # vLLM keeps ``sliding_window - 1 + extra_retained_tokens`` tokens before the
            # next one (its sliding-window manager); never fewer than the window's blocks.
            w, bs = int(spec.sliding_window), int(spec.block_size)
            extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
            window = max(1, -(-w // bs), -(-(w - 1 + extra) // bs))
        else:
            raise ValueError(
                f"{who}: KV cache group {i} is {kind_name} (layers "
                f"{', '.join(layers[:4])}{', ...' if len(layers) > 4 else ''}); tiercache "
                "serves full-attention and sliding-window attention groups only (Mamba and "
                "linear-attention state, chunked local attention and other kinds are refused "
                "rather than served wrong)"
            )
        name = ""
        if len(groups) > 1:
            w_part = f"/{int(spec.sliding_window)}" if kind == "sliding_window" else ""
            name = f"{kind}{w_part}/{','.join(layers)}"
        block_bytes = int(spec.page_size_bytes) * len(layers)
        out.append(KVGroup(i, name, kind, layers, window, block_bytes))
    sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    nbytes = {g.block_bytes for g in out}
    if len(sizes) > 1 or len(nbytes) > 1:
        raise ValueError(
            f"{who}: KV cache groups with block sizes {sorted(sizes)} and "
            f"{sorted(nbytes)} bytes per block; tiercache needs one block size and one number "
            "of bytes per block across groups"
        )
    return tuple(out)


def groups_tag(groups: Sequence[KVGroup]) -> str:
    """The part of a store's layout naming a hybrid model's groups (kind and layer count of
    each), so that its blocks are never read as the same model's without groups; "" for one."""
    if len(groups) < 2:
        return ""
    return "/groups:" + "+".join(f"{g.kind}:{len(g.layers)}" for g in groups)


def window_positions(group: KVGroup, start: int, end: int) -> range:
    """Block positions of `group` that a hit covering blocks [start, end) loads: all of them
    for full attention, the last `window_blocks` for a sliding window."""
    if group.window_blocks:
        return range(max(start, end - group.window_blocks), end)
    return range(start, end)


def hit_end(
    groups: Sequence[KVGroup],
    start: int,
    full_end: int,
    has: Callable[[int, int], bool],
) -> int:
    """The longest hit from block `start` every group can serve: the largest ``end <=
    full_end`` (full-attention groups hold blocks [start, full_end)) such that every
    sliding-window group holds the blocks of its window before `end` (``has(group, pos)``);
    `start` when there is none."""
    windows = [g for g in groups if g.window_blocks]
    for end in range(full_end, start, -1):
        if all(has(g.index, p) for g in windows for p in window_positions(g, start, end)):
            return end
    return start
