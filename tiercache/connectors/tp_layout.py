"""Which block layout a vLLM engine's store uses across tensor-parallel sizes (issue 32).

`choose_shards(extra, ...)` reads ``kv_connector_extra_config``'s ``tp_layout`` and ``max_tp``:
``"auto"`` (default): head shards (`tiercache.transfer.head_shards`) wherever the engine allows
them, so that engines of any TP size share one store, else the per-rank layout (a log line
says why); ``"heads"``: head shards, or a `ConfigError` naming what prevents them; ``"rank"``:
one store per rank (`tp{r}of{n}` paths). ``max_tp`` is the number of head shards per block
(default `default_shards` of the model's KV heads; one the model or the TP size cannot use is
refused in every mode). Head shards need one KV cache group, KV heads split by TP (not MLA,
not replicated), unpadded pages and vLLM's ``LBHNC`` layout.

Also `blocks_as_shards` (a tier's ``blocks`` in shards) and `check_no_rank_dirs` (a head-shard
store refuses a path holding per-rank stores).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiercache.config import CacheConfig
from tiercache.connectors.namespace import map_tiers
from tiercache.errors import ConfigError
from tiercache.tiers import available_kinds, tier_class
from tiercache.transfer.head_shards import HeadShards, default_shards

log = logging.getLogger("tiercache.connectors.tp_layout")

TP_LAYOUTS = ("auto", "heads", "rank")
_RANK_DIR = re.compile(r"tp\d+of\d+")


def _field(name: str) -> str:
    return f"kv_connector_extra_config.{name}"


def read_tp_layout(extra: Mapping[str, Any] | None) -> tuple[str, int | None]:
    """(``tp_layout``, ``max_tp`` or None) from ``kv_connector_extra_config``, checked."""
    extra = extra or {}
    mode = extra.get("tp_layout", "auto")
    if mode not in TP_LAYOUTS:
        raise ConfigError(_field("tp_layout"), f"expected one of {TP_LAYOUTS}, got {mode!r}")
    max_tp = extra.get("max_tp")
    bad = isinstance(max_tp, bool) or not isinstance(max_tp, int) or max_tp < 1
    if max_tp is not None and bad:
        raise ConfigError(_field("max_tp"), f"expected an int >= 1, got {max_tp!r}")
    return mode, max_tp


def choose_shards(
    extra: Mapping[str, Any] | None,
    *,
    spec: Any,
    groups: int,
    kv_cache_layout: str | None,
    total_kv_heads: int | None,
    tp_size: int,
    tp_rank: int,
) -> HeadShards | None:
    """The head shards of this rank (None: the per-rank layout). `spec` is vLLM's KV cache
    spec of group 0, `groups` the number of groups, `total_kv_heads` over all ranks."""
    mode, max_tp = read_tp_layout(extra)
    if mode == "rank":
        return None
    heads = getattr(spec, "num_kv_heads", None)
    total = total_kv_heads if total_kv_heads else (heads * tp_size if heads else None)
    why = None
    if groups > 1:
        why = f"a hybrid model ({groups} KV cache groups) keeps one store per rank"
    elif heads is None or "MLA" in type(spec).__name__:
        why = f"{type(spec).__name__} has no KV heads to shard"
    elif getattr(spec, "page_size_padded", None) is not None or getattr(
        spec, "num_head_slots", None
    ) not in (None, heads):
        why = f"{type(spec).__name__} pages are padded or packed"
    elif str(kv_cache_layout or "").upper().rsplit(".", 1)[-1] != "LBHNC":
        why = f"vLLM's KV cache layout is {kv_cache_layout or 'not named'}, not LBHNC"
    elif total is None or heads * tp_size != total:
        why = f"TP size {tp_size} replicates the model's {total} KV heads ({heads} per rank)"
    if why is None:
        assert total is not None
        shards = max_tp or default_shards(total)
        if total % shards:
            raise ConfigError(
                _field("max_tp"), f"{shards} does not divide the model's {total} KV heads"
            )
        if shards % tp_size:
            problem = f"TP size {tp_size} does not divide {shards} head shards per block"
            if max_tp is not None or mode == "heads":
                raise ConfigError(_field("max_tp"), f"{problem}; use a max_tp that it divides")
            why = f"{problem} (set max_tp, e.g. {total}, to share the store across TP sizes)"
        else:
            return HeadShards(shards, tp_size, tp_rank)
    if mode == "heads":
        raise ConfigError(_field("tp_layout"), f"'heads' is not possible here: {why}")
    log.info("tiercache: one store per TP rank (tp_layout 'rank'): %s", why)
    return None


def blocks_as_shards(user: Mapping[str, Any], shards: HeadShards) -> dict[str, Any]:
    """The user's config mapping with each tier's ``blocks`` (engine blocks) in shards: this
    rank's (`local`) per block, or every rank's (`shards`) where the capacity is the store's."""

    def in_shards(_: int, t: Any) -> list[Any]:
        n = t.get("blocks") if isinstance(t, Mapping) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            t = {**t, "blocks": n * (shards.shards if _store_capacity(t) else shards.local)}
        return [t]

    return map_tiers(user, in_shards)


def _store_capacity(tier: Mapping[str, Any]) -> bool:
    """Whether the tier kind's capacity bounds the whole store; False for a kind that does
    not resolve (resolve_config reports it)."""
    kind = tier.get("kind")
    if not isinstance(kind, str) or kind not in available_kinds():
        return False
    try:
        return tier_class(kind).store_capacity
    except ConfigError:
        return False


def check_no_rank_dirs(config: CacheConfig) -> None:
    """ConfigError for a tier path of `config` holding per-rank stores (see the module doc)."""
    for i, t in enumerate(config.tiers):
        path = t.options.get("path")
        if not isinstance(path, str) or not Path(path).is_dir():
            continue
        found = sorted(p.name for p in Path(path).iterdir() if _RANK_DIR.fullmatch(p.name))
        if found:
            raise ConfigError(
                f"tiers[{i}].path",
                f"{path!r} holds per-rank stores ({', '.join(found)}) written with "
                "tp_layout 'rank' (tiercache before head shards); give this store another "
                "path, or set kv_connector_extra_config.tp_layout = 'rank' to keep using them",
            )
