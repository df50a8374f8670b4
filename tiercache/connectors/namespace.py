"""What a vLLM adapter's cache is opened with: the user's config and the keys' namespace.

Primitives: `read_user_config` and `map_tiers` (the user's config mapping), `resolve_config`
(it with vLLM's block size and the derived namespace), `derive_namespace` and
`namespace_from_vllm` (what makes KV bytes incompatible: model, KV dtype, block size, layout,
TP size and rank, and a digest of every other KV-affecting setting, `kv_settings`), and
`extra_keys_for` (a request's per-block extra keys: LoRA name, cache salt, multimodal inputs).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from xxhash import xxh3_128_hexdigest

from tiercache.config import CacheConfig, read_toml
from tiercache.errors import ConfigError, check_count
from tiercache.hashing import make_namespace

CONFIG_KEY = "config"


def read_user_config(extra_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``config`` entry of ``kv_connector_extra_config`` as a dict (read from TOML if it is
    a path). Raises `ConfigError` naming the problem."""
    if extra_config is None or CONFIG_KEY not in extra_config:
        raise ConfigError(
            f"kv_connector_extra_config.{CONFIG_KEY}",
            "missing; give a tiercache config mapping or the path of a TOML file",
        )
    source = extra_config[CONFIG_KEY]
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str | Path):
        return read_toml(source)
    raise ConfigError(
        f"kv_connector_extra_config.{CONFIG_KEY}",
        f"expected a mapping or a TOML path, got {type(source).__name__}",
    )


def resolve_config(user: Mapping[str, Any], *, block_size: int, namespace: str) -> CacheConfig:
    """A validated `CacheConfig` from the user's mapping: `block_size` from the engine (a
    different one in `user` is an error), `namespace` derived (the user's kept as prefix)."""
    m = dict(user)
    given = m.get("block_size")
    if given is not None and given != block_size:
        raise ConfigError(
            "block_size",
            f"{given!r} differs from the engine's block size {block_size}; "
            "leave it out (the connector takes the engine's)",
        )
    m["block_size"] = block_size
    m["namespace"] = user_prefixed(m, namespace)
    return CacheConfig.from_mapping(m)


def user_prefixed(user: Mapping[str, Any], derived: str) -> str:
    """`derived`, behind the user's own `namespace` (if any) as a prefix: ``user|derived``."""
    prefix = user.get("namespace")
    if prefix is not None and (not isinstance(prefix, str) or not prefix):
        raise ConfigError("namespace", f"expected a non-empty string, got {prefix!r}")
    return f"{prefix}|{derived}" if prefix else derived


def map_tiers(user: Mapping[str, Any], fn: Callable[[int, Any], list[Any]]) -> dict[str, Any]:
    """A copy of the user's config mapping with each entry of ``tiers`` replaced by
    ``fn(index, entry)`` (the tiers it stands for); unchanged where ``tiers`` is not a list
    (`resolve_config` reports that)."""
    m = dict(user)
    tiers = m.get("tiers")
    if isinstance(tiers, list | tuple):
        m["tiers"] = [new for i, t in enumerate(tiers) for new in fn(i, t)]
    return m


def derive_namespace(
    *,
    model: str,
    kv_dtype: str,
    block_size: int,
    layout: str,
    tp_size: int | None = 1,
    tp_rank: int = 0,
    settings: str = "",
) -> str:
    """`make_namespace` of byte-compatible KV blocks; `settings`: `kv_settings_digest` of the
    engine's config; `tp_size` None: bytes that do not depend on TP (head shards)."""
    return make_namespace(
        model=model,
        dtype=kv_dtype,
        block_size=block_size,
        layout=layout,
        tp_size=tp_size,
        tp_rank=tp_rank,
        extra=f"kv-settings={settings}" if settings else "",
    )


# Keys of the model's (effective) Hugging Face config that name or annotate it without
# changing what its attention computes; everything else in it is part of the digest.
_HF_COSMETIC = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        "name_or_path",
    }
)


def _plain(value: Any) -> Any:
    """JSON-able and the same in every process: containers walked, scalars kept, enums by
    name, dataclasses and objects with `to_dict()` by their fields, any other object by its
    type name (its repr could hold a memory address)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if str(k) not in _HF_COSMETIC}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if value is None or isinstance(value, bool | int | float | str):
        return value
    name = type(value).__module__ + "." + type(value).__qualname__
    if isinstance(value, enum.Enum):
        return f"{name}.{value.name}"
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _plain(to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name, None)) for f in dataclasses.fields(value)}
    if name.startswith("torch."):
        return str(value)  # a dtype or device prints the same in every process
    return f"<{name}>"


# Settings outside the Hugging Face config that change the KV bytes (or, for the encoder
# connector, the encoder outputs), by the `VllmConfig` section they live in. Left out on
# purpose: what only bounds or schedules work (max_model_len, memory, limits, cache sizes,
# enforce_eager/compilation, seeds, tokenizer), and what is a per-request extra key of every
# block already (LoRA, cache_salt, multimodal inputs).
_KV_FIELDS: dict[str, tuple[str, ...]] = {
    "model_config": (
        "dtype",  # the compute dtype: K/V are computed in it (the cache dtype may differ)
        "revision",
        "code_revision",
        "model_weights",  # weights loaded from elsewhere than `model`
        "quantization",  # online quantization
        "quantization_config",
        "model_impl",  # vLLM's or transformers' implementation
        "model_class_overrides",
        "runner",
        "convert",
        "disable_sliding_window",
    ),
    "cache_config": ("cache_dtype", "calculate_kv_scales", "kv_cache_dtype_skip_layers"),
    "attention_config": ("backend", "backend_per_kind"),
    "multimodal_config": (
        "language_model_only",
        "mm_processor_kwargs",
        "mm_device_do_normalize",
        "mm_encoder_attn_backend",
        "mm_encoder_attn_dtype",
        "video_pruning_rate",
        "video_pruning_method",
    ),
}


def kv_settings(vllm_config: Any) -> dict[str, Any]:
    """Every setting of a vLLM `VllmConfig` that changes the KV bytes a prompt produces,
    besides what the namespace names itself: the model's effective Hugging Face config
    (`model_config.hf_config`, after `hf_overrides`; but `_HF_COSMETIC`), and the fields in
    `_KV_FIELDS` (one this vLLM version lacks reads as None). docs/vllm.md lists them."""
    mc = vllm_config.model_config
    out: dict[str, Any] = {"hf_config": _plain(getattr(mc, "hf_config", None))}
    for section, names in _KV_FIELDS.items():
        cfg = getattr(vllm_config, section, None)
        if section == "multimodal_config":
            cfg = getattr(mc, "multimodal_config", None)
        for f in names:
            out[f"{section}.{f}"] = _plain(getattr(cfg, f, None)) if cfg is not None else None
    return out


def kv_settings_digest(vllm_config: Any) -> str:
    """A short, process-independent digest of `kv_settings(vllm_config)`."""
    body = json.dumps(kv_settings(vllm_config), sort_keys=True, separators=(",", ":"))
    return xxh3_128_hexdigest(body.encode())[:16]


def namespace_from_vllm(
    vllm_config: Any, *, layout: str, tp_rank: int = 0, per_rank: bool = True
) -> str:
    """`derive_namespace` from a vLLM `VllmConfig` (read by attribute; no vLLM import): the
    model's name or path plus revision, the cache dtype (the model's for ``"auto"``) and
    `kv_settings_digest`. `per_rank` False: no TP size or rank (head shards)."""
    model_cfg = vllm_config.model_config
    cache_cfg = vllm_config.cache_config
    model = str(model_cfg.model)
    revision = getattr(model_cfg, "revision", None)
    if revision:
        model = f"{model}@{revision}"
    kv_dtype = str(getattr(cache_cfg, "cache_dtype", "auto") or "auto")
    if kv_dtype == "auto":
        kv_dtype = str(model_cfg.dtype).removeprefix("torch.")
    return derive_namespace(
        model=model,
        kv_dtype=kv_dtype,
        block_size=int(cache_cfg.block_size),
        layout=layout,
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size) if per_rank else None,
        tp_rank=tp_rank if per_rank else 0,
        settings=kv_settings_digest(vllm_config),
    )


def extra_keys_for(
    *,
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[tuple[str, int, int]] = (),
) -> dict[int, tuple[Any, ...]] | None:
    """Extra keys for `prefix_hashes`: LoRA name and cache salt on block 0 (so they change
    every key of the chain), and ``("mm", identifier, offset)`` on each block that a
    multimodal item ``(identifier, offset, length)`` overlaps. None when there are none."""
    check_count("block_size", block_size)
    out: dict[int, list[Any]] = {}
    if lora_name:
        out.setdefault(0, []).append(("lora", str(lora_name)))
    if cache_salt:
        out.setdefault(0, []).append(("salt", str(cache_salt)))
    for i, item in enumerate(mm_items):
        ident, offset, length = item
        if not isinstance(ident, str) or offset < 0 or length < 1:
            raise ValueError(f"mm_items[{i}]: expected (identifier, offset >= 0, length >= 1)")
        for b in range(offset // block_size, (offset + length - 1) // block_size + 1):
            out.setdefault(b, []).append(("mm", ident, offset))
    return {b: tuple(v) for b, v in out.items()} or None
