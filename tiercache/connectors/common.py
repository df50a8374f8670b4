"""Helpers the vLLM adapters share; this module imports no vLLM, so it is unit-tested alone.

Primitives:
- `read_user_config(extra_config) -> dict`: the ``config`` entry of vLLM's
  ``kv_connector_extra_config``, a mapping or a path to a TOML file, as a plain dict.
- `resolve_config(user, *, block_size, namespace) -> CacheConfig`: the user's config with vLLM's
  block size and the derived namespace filled in (a namespace the user gives is kept as a
  prefix; a block size that disagrees with vLLM's is an error).
- `derive_namespace(...)` / `namespace_from_vllm(vllm_config, *, layout, tp_rank)`: what makes
  KV bytes incompatible (model, KV dtype, block size, layout, TP size and rank, and a digest
  of every other KV-affecting setting: `kv_settings(vllm_config)`, see docs/vllm.md).
- `per_rank_config(user, *, tp_rank, tp_size) -> dict` / `resolve_rank_config(...)
  -> RankConfig`: tensor parallelism. Every rank hashes the same block keys (key namespace:
  TP size, rank 0) but keeps its own shard in its own store (store namespace: its rank;
  tier paths in a ``tp{rank}of{size}`` subdirectory, Redis prefixes with the same suffix).
- `per_dp_rank_config(user, *, dp_rank, dp_size) -> dict`: data parallelism (and replicas
  given a rank). Ranks share the store namespace and the shared tiers (LMDB, Redis), so each
  finds what the others stored; each NVMe tier opens its own instance of the configured
  path (`instance = dp_rank`: rank 0 the path itself, rank r ``path/instance{r}``), so a
  restarted rank finds its blocks again. `resolve_rank_config(..., dp_rank=, dp_size=)`
  applies it under the TP resolution (NVMe paths ``path/tp{t}of{n}/instance{r}``).
  `with_nvme_siblings(user)`: head shards, every rank also reads the other NVMe instances.
- `per_rank_telemetry(user, *, tp_rank, tp_size, dp_rank, dp_size) -> dict`: each rank's
  own telemetry directory (``dir/tp{t}of{n}``) and Prometheus port (+ its rank index).
- `acquire_store(config, block_bytes) -> SharedStore` / `release_store(store)` / `find_store`:
  one `TierCache`
  per process and configuration, shared by reference count. vLLM builds a scheduler-role and a
  worker-role connector; in one process both must use one cache (one LMDB environment may be
  opened once per process, and both halves must see one manager). The last release closes
  the cache (flushing persistent tiers); an atexit hook closes what is left.
- `extra_keys_for(...)`: the per-block extra keys of a request (LoRA name, cache salt,
  multimodal inputs) in the form `tiercache.hashing.prefix_hashes` takes.
- `kv_groups(kv_cache_config) -> tuple[KVGroup, ...]`: vLLM's KV cache groups (hybrid KV
  cache manager) as tiercache serves them: a name for the group keys, the layers, the blocks
  a hit's end needs (sliding window), bytes per block; non-attention groups are refused.
  `window_positions(group, start, end)`: which blocks of a group a hit loads;
  `hit_end(groups, start, full_end, has)`: the longest hit every group can serve.
- `store_snapshots() -> dict`: stats and counters of every open shared store (tests, benches).
- `open_probes(config, block_bytes) -> list[StoreProbe]` / `probe_chain(probes, keys)`:
  read-only probes of a config's shared tiers (LMDB, Redis), for a scheduler whose worker
  (and so whose cache) runs in another process.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import threading
import tomllib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xxhash import xxh3_128_hexdigest

from tiercache.cache import TierCache, register_exit_hook
from tiercache.config import CacheConfig, split_addr
from tiercache.errors import ConfigError, check_count
from tiercache.hashing import make_namespace
from tiercache.tiers import tier_class
from tiercache.tiers.base import StoreProbe

log = logging.getLogger(__name__)

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
        p = Path(source)
        try:
            return tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(CONFIG_KEY, f"no such file: {p}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(CONFIG_KEY, f"cannot read {p}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(CONFIG_KEY, f"{p} is not valid TOML: {exc}") from None
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
    m["namespace"] = _user_prefixed(m, namespace)
    return CacheConfig.from_mapping(m)


def _user_prefixed(user: Mapping[str, Any], derived: str) -> str:
    """`derived`, behind the user's own `namespace` (if any) as a prefix: ``user|derived``."""
    prefix = user.get("namespace")
    if prefix is not None and (not isinstance(prefix, str) or not prefix):
        raise ConfigError("namespace", f"expected a non-empty string, got {prefix!r}")
    return f"{prefix}|{derived}" if prefix else derived


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
    """The namespace of KV blocks that are byte-compatible (see `make_namespace`);
    `settings` is `kv_settings_digest` of the engine's configuration; `tp_size` None: blocks
    whose bytes do not depend on TP (head shards: the layout names them)."""
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
    besides the model name, KV dtype, block size, layout and TP (in the namespace itself):

    - the model's effective Hugging Face config (`model_config.hf_config`, after
      `hf_overrides`): rope parameters and scaling, sliding windows, head counts and sizes,
      layer types, norms, quantization_config, ... (only the names above are left out);
    - the fields in `_KV_FIELDS` (compute dtype, revisions, separate weights, online
      quantization, implementation, KV cache dtype and fp8 scales, attention backend, the
      multimodal encoder's settings); a field this vLLM version lacks reads as None.

    docs/vllm.md lists them for users.
    """
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


def _dtype_name(dtype: object) -> str:
    s = str(dtype)
    return s.removeprefix("torch.")


def namespace_from_vllm(
    vllm_config: Any, *, layout: str, tp_rank: int = 0, per_rank: bool = True
) -> str:
    """`derive_namespace` from a vLLM `VllmConfig` (read by attribute; no vLLM import).
    `per_rank` False: a namespace that names no TP size or rank (head shards).

    The model is its name or path plus revision; the KV dtype is the cache dtype, or the
    model dtype when the cache dtype is ``"auto"``; every other KV-affecting setting enters
    through `kv_settings_digest`.
    """
    model_cfg = vllm_config.model_config
    cache_cfg = vllm_config.cache_config
    model = str(model_cfg.model)
    revision = getattr(model_cfg, "revision", None)
    if revision:
        model = f"{model}@{revision}"
    kv_dtype = str(getattr(cache_cfg, "cache_dtype", "auto") or "auto")
    if kv_dtype == "auto":
        kv_dtype = _dtype_name(model_cfg.dtype)
    return derive_namespace(
        model=model,
        kv_dtype=kv_dtype,
        block_size=int(cache_cfg.block_size),
        layout=layout,
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size) if per_rank else None,
        tp_rank=tp_rank if per_rank else 0,
        settings=kv_settings_digest(vllm_config),
    )


def _check_rank(axis: str, rank: int, size: int) -> None:
    """ValueError unless `rank` is one of `size` ranks (`axis`: "tp" or "dp", for the
    message)."""
    if not (isinstance(size, int) and isinstance(rank, int) and 0 <= rank < size):
        raise ValueError(
            f"expected 0 <= {axis}_rank < {axis}_size, got {axis}_rank={rank!r}, "
            f"{axis}_size={size!r}"
        )


def rank_suffix(tp_rank: int, tp_size: int) -> str:
    """``tp{rank}of{size}``: the subdirectory / key-prefix suffix of one TP rank's store."""
    _check_rank("tp", tp_rank, tp_size)
    return f"tp{tp_rank}of{tp_size}"


_REDIS_DEFAULT_PREFIX = "tiercache:"  # tiers.redis's default `prefix`


def per_rank_config(user: Mapping[str, Any], *, tp_rank: int, tp_size: int) -> dict[str, Any]:
    """The user's config mapping for TP rank `tp_rank` of `tp_size`: each tier's `path` gets
    a ``tp{rank}of{size}`` subdirectory and each Redis tier's `prefix` that suffix, so ranks
    never share a store file, an LMDB environment or a Redis key space. With `tp_size` 1 the
    mapping is returned unchanged (TP=1 stores stay where they were)."""
    suffix = rank_suffix(tp_rank, tp_size)
    m = dict(user)
    if tp_size == 1:
        return m
    tiers = m.get("tiers")
    if not isinstance(tiers, list | tuple):
        return m  # resolve_config reports the problem
    out = []
    for t in tiers:
        if not isinstance(t, Mapping):
            out.append(t)
            continue
        t = dict(t)
        path = t.get("path")
        if isinstance(path, str | Path) and str(path):
            t["path"] = str(Path(path).expanduser() / suffix)
        if t.get("kind") == "redis":
            prefix = t.get("prefix", _REDIS_DEFAULT_PREFIX)
            if isinstance(prefix, str):
                t["prefix"] = f"{prefix}{suffix}:"
        out.append(t)
    m["tiers"] = out
    return m


def per_dp_rank_config(
    user: Mapping[str, Any],
    *,
    dp_rank: int,
    dp_size: int,
    setter: str = "the data-parallel rank",
) -> dict[str, Any]:
    """The user's config mapping for data-parallel rank `dp_rank` of `dp_size` engines on one
    host: every NVMe tier gets ``instance = dp_rank`` (see tiers/nvme/layout.py: rank 0 opens the
    path itself, rank r > 0 ``path/instance{r}``); everything else is unchanged: the ranks
    share the namespace, the LMDB and Redis stores (and their capacity) and differ only in
    their private tiers. With `dp_size` 1 the mapping is returned unchanged. ConfigError when
    the user set an NVMe tier's `instance` or `instance_env` (the rank decides it; `setter`
    names what sets it in that message)."""
    _check_rank("dp", dp_rank, dp_size)
    m = dict(user)
    tiers = m.get("tiers")
    if dp_size == 1 or not isinstance(tiers, list | tuple):
        return m  # (a malformed tiers list: resolve_config reports the problem)
    out = []
    for i, t in enumerate(tiers):
        if isinstance(t, Mapping) and t.get("kind") == "nvme":
            for opt in ("instance", "instance_env"):
                if opt in t:
                    raise ConfigError(
                        f"tiers[{i}].{opt}",
                        f"{setter} sets the instance ({dp_size} ranks); leave it out",
                    )
            t = {**t, "instance": dp_rank}
        out.append(t)
    m["tiers"] = out
    return m


def per_rank_telemetry(
    user: Mapping[str, Any], *, tp_rank: int, tp_size: int, dp_rank: int = 0, dp_size: int = 1
) -> dict[str, Any]:
    """The user's config mapping with the `[telemetry]` of one rank: every rank is a process
    of its own with a cache of its own, so each writes its own `stats.json` and events, in
    `dir/tp{t}of{n}` (`dp{r}of{m}`, `tp{t}of{n}-dp{r}of{m}`), and serves Prometheus on the
    configured port + dp_rank * tp_size + tp_rank (they would otherwise overwrite each
    other's files, and every rank after the first would fail to open on the taken port). A
    port of 0 (any free one) stays 0. One rank (TP and DP 1): unchanged."""
    m = dict(user)
    tel = m.get("telemetry")
    if (tp_size == 1 and dp_size == 1) or not isinstance(tel, Mapping):
        return m  # (a malformed table: resolve_config reports the problem)
    parts = [rank_suffix(tp_rank, tp_size)] if tp_size > 1 else []
    if dp_size > 1:
        parts.append(f"dp{dp_rank}of{dp_size}")
    tel = dict(tel)
    d = tel.get("dir")
    if isinstance(d, str | Path) and str(d):
        tel["dir"] = str(Path(d).expanduser() / "-".join(parts))
    prom = tel.get("prometheus")
    if prom is not None:
        try:
            host, port = split_addr(prom, "telemetry.prometheus")
        except ConfigError:
            pass  # resolve_config reports it
        else:
            if port:
                tel["prometheus"] = f"{host}:{port + dp_rank * tp_size + tp_rank}"
    m["telemetry"] = tel
    return m


@dataclass(frozen=True)
class RankConfig:
    """One TP rank's view: `config` is its own store (namespace with its rank, per-rank
    paths); `key_namespace` is what block keys are hashed with, the same on every rank and in
    the scheduler (TP size, not rank), so one key names the same block on every rank."""

    config: CacheConfig
    key_namespace: str
    tp_rank: int
    tp_size: int
    dp_rank: int = 0
    dp_size: int = 1
    shared: bool = False  # head shards: the ranks share the user's paths


def resolve_rank_config(
    user: Mapping[str, Any],
    *,
    block_size: int,
    key_namespace: str,
    store_namespace: str,
    tp_rank: int,
    tp_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    shared: bool = False,
) -> RankConfig:
    """`resolve_config` for one TP rank of one data-parallel rank: `store_namespace` (derived
    with the TP rank) names the rank's store, `key_namespace` (derived with TP rank 0) the
    keys; a namespace the user gives prefixes both. With `tp_size` 1 both namespaces are
    equal and the paths unchanged; with `dp_size` > 1 each NVMe tier opens instance `dp_rank`
    of its (per-TP-rank) path (`per_dp_rank_config`). With several ranks, each has its own
    telemetry (`per_rank_telemetry`).

    `shared` (head shards, `tiercache.connectors.tp_layout`): every TP rank uses the paths as
    given, so ranks of every TP size share one store per tier; each (DP, TP) rank opens an
    NVMe instance of its own (one writer per instance) and reads the others' read-only
    (`with_nvme_siblings`)."""
    mapping = dict(user) if shared else per_rank_config(user, tp_rank=tp_rank, tp_size=tp_size)
    mapping = per_rank_telemetry(
        mapping, tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size
    )
    # NVMe instances: one per DP rank, or (shared paths) one per (DP, TP) rank.
    instance, instances = (
        (dp_rank * tp_size + tp_rank, dp_size * tp_size) if shared else (dp_rank, dp_size)
    )
    setter = "the (data-parallel, tensor-parallel) rank" if shared else "the data-parallel rank"
    mapping = per_dp_rank_config(mapping, dp_rank=instance, dp_size=instances, setter=setter)
    if shared:
        mapping = with_nvme_siblings(mapping)
    config = resolve_config(mapping, block_size=block_size, namespace=store_namespace)
    keys = _user_prefixed(user, key_namespace)
    return RankConfig(config, keys, tp_rank, tp_size, dp_rank, dp_size, shared)


def with_nvme_siblings(user: Mapping[str, Any]) -> dict[str, Any]:
    """The user's config mapping with, right below each NVMe tier, an ``nvme-siblings``
    tier of the same path (named ``{name}-siblings``): the other instances there, read-only
    (tiers/nvme/siblings.py). Under head shards a rank's shards may sit in another rank's
    instance (written at another TP size): this is how the rank finds them. Nothing is
    written into a sibling; a block loaded from one is promoted into the rank's own tiers.
    The siblings tier skips the NVMe tier's `instance` (0 without one; with `instances` or
    `instance_env`, whichever this process holds)."""
    m = dict(user)
    tiers = m.get("tiers")
    if not isinstance(tiers, list | tuple):
        return m  # (a malformed tiers list: resolve_config reports the problem)
    out: list[Any] = []
    for t in tiers:
        out.append(t)
        path = t.get("path") if isinstance(t, Mapping) and t.get("kind") == "nvme" else None
        if isinstance(path, str | Path) and str(path):
            sib = {"kind": "nvme-siblings", "name": f"{t.get('name', 'nvme')}-siblings"}
            sib |= {"path": str(path), "blocks": 1}
            own = t.get("instance", None if {"instances", "instance_env"} & set(t) else 0)
            out.append(sib if own is None else {**sib, "instance": own})
    m["tiers"] = out
    return m


def prepare_rank_dirs(rank: RankConfig) -> None:
    """With several ranks, create (0700) the directory each per-rank path lives in (the
    path the user gave: tier paths with TP > 1, the telemetry directory with TP or DP > 1),
    as a tier or the telemetry creates its own path with one rank: only when that
    directory's parent exists (otherwise the tier or telemetry reports the missing one)."""
    parents = []
    if rank.tp_size > 1 and not rank.shared:
        suffix = rank_suffix(rank.tp_rank, rank.tp_size)
        for t in rank.config.tiers:
            path = t.options.get("path")
            if isinstance(path, str) and Path(path).name == suffix:
                parents.append(Path(path).parent)
    tel = rank.config.telemetry
    if tel is not None and (rank.tp_size > 1 or rank.dp_size > 1):
        parents.append(Path(tel.dir).parent)
    for parent in parents:
        if not parent.exists() and parent.parent.is_dir():
            try:
                parent.mkdir(mode=0o700)
            except FileExistsError:  # another rank made it meanwhile
                pass
            except OSError as exc:
                log.warning("cannot create %s for the per-rank paths: %s", parent, exc)


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


# vLLM KV cache spec classes served as attention: full attention (and MLA, a subclass), and
# sliding windows. Names, not classes: this module imports no vLLM.
_FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
_WINDOW_SPECS = frozenset({"SlidingWindowSpec"})


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group as tiercache serves it.

    `name` goes into the group keys (`tiercache.hashing.group_keys`; "" for a model with one
    group, whose keys stay the plain prefix keys). `window_blocks` is 0 for full attention;
    for a sliding window, how many blocks before a hit's end its layers read (what vLLM's
    sliding-window manager keeps, at least ``ceil(window / block_size)``)."""

    index: int
    name: str
    kind: str  # "full_attention" | "sliding_window"
    layers: tuple[str, ...]
    window_blocks: int
    block_bytes: int


def kv_groups(kv_cache_config: Any, who: str = "TierCacheConnector") -> tuple[KVGroup, ...]:
    """vLLM's `KVCacheConfig.kv_cache_groups` as `KVGroup`s (read by attribute).

    Raises ValueError naming the group and its spec for what tiercache cannot serve right:
    non-attention state (Mamba, linear attention: one state per request, not per block of
    tokens), chunked local attention and other attention kinds, and groups whose block sizes
    or bytes per block differ (the store has one block size). `who` names the adapter."""
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
    each), so that its blocks, one group's layers each, are never read as one group's blocks
    of the same model (the hybrid manager off); empty for one group."""
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


@dataclass(eq=False)
class SharedStore:
    """One open `TierCache` shared by the adapters of one process.

    `lock` serialises every use of the cache's manager by the adapters (scheduler and worker
    halves may run on different threads). `counters` are adapter counters (loads, stores,
    errors) that tests and benches read with `store_snapshots()`; `state` is free for an
    adapter's cross-role bookkeeping (e.g. requests still being saved).
    """

    key: tuple[Any, ...]
    cache: TierCache
    lock: threading.RLock = field(init=False)
    refs: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    before_close: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # The cache's own lock: its write-through thread and the adapters then take turns.
        self.lock = self.cache.lock

    def close(self) -> None:
        """Run the `before_close` hooks (e.g. a worker finishing its transfers), then close
        the cache (write-back to persistent tiers, flush); idempotent."""
        hooks, self.before_close = self.before_close, []
        for hook in hooks:
            try:
                hook()
            except Exception:  # a failing hook must not keep the tiers from closing
                log.exception("a before-close hook of the shared tiercache store failed")
        # Not under `lock`: close joins the cache's write-through thread, which takes it.
        self.cache.close()

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to counter `name` (caller holds `lock` or accepts a racy count)."""
        self.counters[name] = self.counters.get(name, 0) + n


_REGISTRY: dict[tuple[Any, ...], SharedStore] = {}
_REGISTRY_LOCK = threading.Lock()


def _store_key(config: CacheConfig) -> tuple[Any, ...]:
    # Two configs with the same namespace and tiers are one store; the tier options are part
    # of the key so that a different path never silently shares a cache.
    tiers = tuple(
        (
            t.kind,
            t.name,
            t.capacity_bytes,
            t.capacity_blocks,
            tuple(sorted(map(repr, t.options.items()))),
        )
        for t in config.tiers
    )
    return (config.namespace, config.block_size, config.promote, tiers)


def acquire_store(config: CacheConfig, block_bytes: int) -> SharedStore:
    """The process's shared store for `config`, opened on first use; call `release_store`
    once per acquire. A second acquire with another `block_bytes` is an error."""
    key = _store_key(config)
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(key)
        if shared is None:
            shared = SharedStore(key=key, cache=TierCache.open(config, block_bytes=block_bytes))
            _REGISTRY[key] = shared
        elif shared.cache.block_bytes != block_bytes:
            raise ValueError(
                f"block_bytes: the store for namespace {config.namespace!r} is open with "
                f"{shared.cache.block_bytes}-byte blocks, asked for {block_bytes}"
            )
        shared.refs += 1
        return shared


def find_store(config: CacheConfig) -> SharedStore | None:
    """The process's open shared store for `config`, if any (takes no reference)."""
    with _REGISTRY_LOCK:
        return _REGISTRY.get(_store_key(config))


def release_store(shared: SharedStore) -> None:
    """Drop one reference; the last one closes the cache (write-back and flush)."""
    with _REGISTRY_LOCK:
        if shared.refs <= 0:
            return
        shared.refs -= 1
        if shared.refs:
            return
        _REGISTRY.pop(shared.key, None)
    shared.close()


def store_snapshots() -> dict[str, dict[str, Any]]:
    """Per open shared store (by namespace): the cache's `stats()`, the adapter counters and
    the adapters' snapshot sections (`TierCache.sections`, e.g. `kv_groups`)."""
    with _REGISTRY_LOCK:
        stores = list(_REGISTRY.values())
    out: dict[str, dict[str, Any]] = {}
    for s in stores:
        with s.lock:
            out[s.cache.config.namespace] = {
                "stats": s.cache.stats(),
                "counters": dict(s.counters),
                "sections": s.cache.sections(),
                "refs": s.refs,
            }
    return out


def _close_all() -> None:
    """Backstop: close stores whose adapters were never shut down (a clean exit)."""
    with _REGISTRY_LOCK:
        stores = list(_REGISTRY.values())
        _REGISTRY.clear()
    for s in stores:
        try:
            s.close()
        except Exception:  # one failing store must not keep the others from closing
            log.exception("closing the shared tiercache store %r at exit failed", s.key[0])


register_exit_hook(_close_all)  # before concurrent.futures stops taking work


def open_probes(config: CacheConfig, block_bytes: int) -> list[tuple[str, StoreProbe]]:
    """Read-only probes of `config`'s shared tiers, fastest first (`Tier.open_probe`), with
    each tier's medium. A tier whose probe cannot be made is left out with a warning:
    probing only finds more hits."""
    probes: list[tuple[str, StoreProbe]] = []
    for t in config.tiers:
        try:
            probe = tier_class(t.kind).open_probe(t, block_bytes, namespace=config.namespace)
        except (ConfigError, OSError) as exc:
            log.warning("tiercache: no probe of tier %s (%s): %s", t.name, t.kind, exc)
            continue
        if probe is not None:
            probes.append((t.name, probe))
    return probes


def probe_chain(
    probes: Sequence[tuple[str, StoreProbe]],
    keys: Sequence[bytes],
    off: Collection[str] = (),
) -> int:
    """How many leading `keys` the first probe that holds any of them holds: as the manager's
    discovery adopts them (one shared tier's leading run per lookup miss). Mediums in `off`
    (suspended) are not asked."""
    for medium, p in probes:
        if medium in off:
            continue
        n = p.probe(keys)
        if n:
            return n
    return 0
