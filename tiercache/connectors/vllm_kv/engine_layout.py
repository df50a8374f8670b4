"""The engine's KV buffer as the worker role sees it, and its report for telemetry.

- `engine_layout(kv_caches, settings)`: the buffer as one `KVLayout` (a plain model's, a
  hybrid model's overlaid groups' (`group_layout`), or one of head-shard units).
- `kv_report(settings, counters)`: per KV cache group and for the TP layout, what
  `tiercache stats`/`inspect` show.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tiercache.connectors.kv_groups import KVGroup
from tiercache.connectors.vllm_kv.settings import KVSettings
from tiercache.transfer import KVLayout


def engine_layout(kv_caches: dict[str, torch.Tensor], settings: KVSettings) -> KVLayout:
    """The layout of vLLM's KV caches `kv_caches` (see the module doc); ValueError where
    tiercache cannot serve it."""
    num_blocks, shards = settings.num_blocks, settings.shards
    if settings.hma:
        layout = group_layout(kv_caches, settings.groups, num_blocks)
    elif shards is not None:
        try:
            units = shards.unit_views(kv_caches, num_blocks, settings.kv_heads)
        except ValueError as exc:
            raise ValueError(
                f"register_kv_caches: {exc}; set kv_connector_extra_config.tp_layout to "
                "'rank' for one store per TP rank"
            ) from None
        layout = KVLayout(units, num_blocks * shards.local)
    else:
        layout = KVLayout(kv_caches, num_blocks)
    if layout.block_bytes != settings.block_bytes:
        raise ValueError(
            f"register_kv_caches: the engine's blocks are {layout.block_bytes} bytes, but "
            f"kv_cache_config says {settings.block_bytes}; layout not supported"
        )
    return layout


def group_layout(
    kv_caches: dict[str, torch.Tensor], groups: tuple[KVGroup, ...], num_blocks: int
) -> KVLayout:
    """The block layout of a hybrid model's KV caches: vLLM overlays its groups (layer j of
    every group views one tensor; a block id belongs to one group at a time), so one group's
    layout serves every group. Anything else is refused."""
    layouts = [KVLayout({n: kv_caches[n] for n in g.layers}, num_blocks) for g in groups]

    def shape(layout: KVLayout) -> tuple[Any, ...]:
        return tuple(
            (s.rows.data_ptr(), tuple(s.rows.shape), tuple(s.rows.stride()), s.offset)
            for s in layout.segments
        )

    first = shape(layouts[0])
    for g, layout in zip(groups[1:], layouts[1:], strict=True):
        if shape(layout) != first:
            raise ValueError(
                f"register_kv_caches: KV cache group {g.index} ({g.kind}) does not share the "
                "block layout of group 0 (vLLM did not overlay the groups' tensors); "
                "not supported"
            )
    return layouts[0]


def kv_report(settings: KVSettings, counters: Mapping[str, int]) -> dict[str, Any]:
    """Per KV cache group: kind, layers, window, bytes per block, the blocks it keeps for the
    tokens this process stored (`counters`) and so its bytes per token; and the TP layout."""
    tokens = counters.get("kept_tokens", 0)
    groups = []
    for g in settings.groups:
        kept = counters.get(f"kept_blocks_g{g.index}", 0)
        groups.append(
            {
                "group": g.index,
                "kind": g.kind,
                "layers": len(g.layers),
                "window_blocks": g.window_blocks,
                "block_bytes": g.block_bytes,
                "kept_blocks": kept,
                "bytes_per_token": round(kept * g.block_bytes / tokens, 1) if tokens else None,
            }
        )
    return {
        "block_size": settings.block_size,
        "kept_tokens": tokens,
        "groups": groups,
        "tp_layout": layout_report(settings),
    }


def layout_report(settings: KVSettings) -> dict[str, Any]:
    """The block layout across TP sizes (`tiercache.connectors.tp_layout`), for inspect."""
    sh, tp, rank = settings.shards, settings.tp_size, settings.tp_rank
    if sh is None:
        return {"layout": "rank", "tp_size": tp, "tp_rank": rank}
    return {
        "layout": "heads",
        "shards": sh.shards,
        "tp_size": tp,
        "tp_rank": rank,
        "owned_shards": [sh.owned.start, sh.owned.stop - 1],
    }
