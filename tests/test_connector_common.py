"""`tiercache.connectors.common`: config loading, namespaces, extra keys, the shared-store
registry. No vLLM needed (vLLM's config objects are stood in for by plain namespaces)."""

from __future__ import annotations

import dataclasses
import enum
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from tests.ports import free_port
from tiercache.cli import main
from tiercache.connectors import stores
from tiercache.connectors.kv_groups import hit_end, kv_groups, window_positions
from tiercache.connectors.namespace import (
    derive_namespace,
    extra_keys_for,
    kv_settings,
    kv_settings_digest,
    namespace_from_vllm,
    read_user_config,
    resolve_config,
)
from tiercache.connectors.ranks import (
    per_rank_config,
    per_rank_telemetry,
    prepare_rank_dirs,
    resolve_rank_config,
)
from tiercache.connectors.stores import acquire_store, find_store, release_store, store_snapshots
from tiercache.errors import ConfigError
from tiercache.hashing import prefix_hashes
from tiercache.telemetry import read_stats


class _HFConfig:
    """Stands in for a transformers config: `to_dict()` of its attributes."""

    def __init__(self, **fields: object) -> None:
        self.fields = {
            "_name_or_path": "/models/llama",
            "transformers_version": "5.0.0",
            "num_attention_heads": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            **fields,
        }

    def to_dict(self) -> dict[str, object]:
        return dict(self.fields)


def _vllm_config(**over: object) -> SimpleNamespace:
    model = SimpleNamespace(
        model="org/llama",
        revision=None,
        dtype="torch.bfloat16",
        hf_config=_HFConfig(),
        quantization=None,
    )
    cache = SimpleNamespace(cache_dtype="auto", block_size=32, calculate_kv_scales=False)
    parallel = SimpleNamespace(tensor_parallel_size=1)
    cfg = SimpleNamespace(model_config=model, cache_config=cache, parallel_config=parallel)
    for path, value in over.items():
        section, _, attr = path.rpartition("__")
        setattr(getattr(cfg, section) if section else cfg, attr, value)
    return cfg


# -- config ------------------------------------------------------------------------------------
def test_read_user_config_mapping_and_toml(tmp_path: Path) -> None:
    tiers = [{"kind": "cpu", "blocks": 4}]
    assert read_user_config({"config": {"tiers": tiers}}) == {"tiers": tiers}
    toml = tmp_path / "tc.toml"
    toml.write_text('namespace = "prod"\n[[tiers]]\nkind = "cpu"\nblocks = 4\n')
    assert read_user_config({"config": str(toml)}) == {"namespace": "prod", "tiers": tiers}
    assert read_user_config({"config": toml}) == {"namespace": "prod", "tiers": tiers}


@pytest.mark.parametrize(
    ("extra", "field", "problem"),
    [
        (None, "kv_connector_extra_config.config", "missing"),
        ({}, "kv_connector_extra_config.config", "missing"),
        ({"config": 3}, "kv_connector_extra_config.config", "got int"),
        ({"config": "/nonexistent/tc.toml"}, "config", "no such file"),
    ],
)
def test_read_user_config_errors_name_the_problem(extra: object, field: str, problem: str) -> None:
    with pytest.raises(ConfigError) as exc:
        read_user_config(extra)  # type: ignore[arg-type]
    assert exc.value.field == field
    assert problem in str(exc.value)


def test_read_user_config_bad_toml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("tiers = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        read_user_config({"config": str(bad)})


def test_resolve_config_fills_block_size_and_prefixes_namespace() -> None:
    user = {"tiers": [{"kind": "cpu", "blocks": 4}]}
    cfg = resolve_config(user, block_size=32, namespace="derived")
    assert (cfg.block_size, cfg.namespace) == (32, "derived")
    cfg = resolve_config({**user, "namespace": "team-a"}, block_size=32, namespace="derived")
    assert cfg.namespace == "team-a|derived"
    # The same block size as the engine's is accepted; another one is refused.
    assert resolve_config({**user, "block_size": 32}, block_size=32, namespace="d").block_size
    with pytest.raises(ConfigError, match="differs from the engine's block size 32"):
        resolve_config({**user, "block_size": 16}, block_size=32, namespace="d")
    with pytest.raises(ConfigError, match="namespace"):
        resolve_config({**user, "namespace": ""}, block_size=32, namespace="d")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.kind"):
        resolve_config({"tiers": [{"kind": "tape", "blocks": 4}]}, block_size=32, namespace="d")


# -- namespace ---------------------------------------------------------------------------------
def test_namespace_from_vllm_names_what_makes_kv_incompatible() -> None:
    base = namespace_from_vllm(_vllm_config(), layout="NHD/cpu")
    assert base == derive_namespace(
        model="org/llama",
        kv_dtype="bfloat16",
        block_size=32,
        layout="NHD/cpu",
        settings=kv_settings_digest(_vllm_config()),
    )
    rope = {"rope_type": "default", "rope_theta": 500.0}
    variants = [
        # Settings that change the KV bytes without changing the model's name (issue 14:
        # an hf_overrides of rope_theta was served another engine's KV).
        namespace_from_vllm(
            _vllm_config(model_config__hf_config=_HFConfig(rope_parameters=rope)), layout="NHD/cpu"
        ),
        namespace_from_vllm(
            _vllm_config(model_config__hf_config=_HFConfig(sliding_window=64)), layout="NHD/cpu"
        ),
        namespace_from_vllm(_vllm_config(model_config__quantization="fp8"), layout="NHD/cpu"),
        namespace_from_vllm(_vllm_config(cache_config__calculate_kv_scales=True), layout="NHD/cpu"),
        namespace_from_vllm(_vllm_config(model_config__model="org/other"), layout="NHD/cpu"),
        namespace_from_vllm(_vllm_config(model_config__revision="v2"), layout="NHD/cpu"),
        namespace_from_vllm(_vllm_config(cache_config__cache_dtype="fp8"), layout="NHD/cpu"),
        namespace_from_vllm(_vllm_config(model_config__dtype="torch.float16"), layout="NHD/cpu"),
        namespace_from_vllm(_vllm_config(cache_config__block_size=64), layout="NHD/cpu"),
        namespace_from_vllm(_vllm_config(), layout="HND/cuda"),
        namespace_from_vllm(_vllm_config(parallel_config__tensor_parallel_size=2), layout="x"),
        namespace_from_vllm(
            _vllm_config(parallel_config__tensor_parallel_size=2), layout="x", tp_rank=1
        ),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # Deterministic: the same inputs give the same string (it is hashed into every key).
    assert namespace_from_vllm(_vllm_config(), layout="NHD/cpu") == base
    # What only names or annotates the model changes nothing, nor does an object whose repr
    # holds a memory address (another process would print another one).
    cosmetic = _HFConfig(_name_or_path="/elsewhere", transformers_version="5.1", odd=object())
    same = _vllm_config(model_config__hf_config=cosmetic)
    again = _vllm_config(model_config__hf_config=_HFConfig(odd=object()))
    assert kv_settings_digest(same) == kv_settings_digest(again)
    assert "odd" in kv_settings(same)["hf_config"]


class _Backend(enum.Enum):
    FLASH_ATTN = 1
    FLASHINFER = 2


@dataclasses.dataclass
class _QuantArgs:
    method: str = "fp8"
    activation_scheme: str = "dynamic"


def test_settings_beside_the_hf_config_change_the_namespace() -> None:
    """Settings outside the HF config that change KV bytes (issue 14, item 4). With an fp8 KV
    cache the namespace's dtype is the cache dtype, so the compute dtype must come from the
    digest; separate weights, online quantization arguments, the implementation, sliding
    windows switched off, layers kept out of fp8 and the attention backend all change K/V."""
    fp8 = {"cache_config__cache_dtype": "fp8"}
    base = namespace_from_vllm(_vllm_config(**fp8), layout="NHD/cuda")
    variants = [
        _vllm_config(**fp8, model_config__dtype="torch.float16"),
        _vllm_config(**fp8, model_config__model_weights="/weights/finetuned"),
        _vllm_config(**fp8, model_config__code_revision="abc123"),
        _vllm_config(**fp8, model_config__quantization_config=_QuantArgs()),
        _vllm_config(**fp8, model_config__quantization_config=_QuantArgs(activation_scheme="s")),
        _vllm_config(**fp8, model_config__model_impl="transformers"),
        _vllm_config(**fp8, model_config__disable_sliding_window=True),
        _vllm_config(**fp8, cache_config__kv_cache_dtype_skip_layers=["0"]),
        _vllm_config(**fp8, attention_config=SimpleNamespace(backend=_Backend.FLASH_ATTN)),
        _vllm_config(**fp8, attention_config=SimpleNamespace(backend=_Backend.FLASHINFER)),
    ]
    names = [namespace_from_vllm(v, layout="NHD/cuda") for v in variants]
    assert len({base, *names}) == len(names) + 1
    # Deterministic: equal settings, equal namespaces; an enum reads by its name.
    again = _vllm_config(**fp8, attention_config=SimpleNamespace(backend=_Backend.FLASH_ATTN))
    assert namespace_from_vllm(again, layout="NHD/cuda") == names[8]
    settings = kv_settings(variants[8])
    assert settings["attention_config.backend"].endswith("_Backend.FLASH_ATTN")
    assert kv_settings(variants[3])["model_config.quantization_config"] == {
        "method": "fp8",
        "activation_scheme": "dynamic",
    }


# -- tensor parallel ranks ---------------------------------------------------------------------
_TP_USER = {
    "namespace": "team",
    "tiers": [
        {"kind": "cpu", "blocks": 4},
        {"kind": "nvme", "path": "/srv/tc/nvme", "blocks": 8},
        {"kind": "lmdb", "path": "/srv/tc/lmdb", "blocks": 8},
        {"kind": "redis", "url": "redis://h:6379/0", "blocks": 8},
        {"kind": "redis", "name": "r2", "prefix": "kv:", "blocks": 8},
    ],
}


def test_per_rank_config_gives_each_rank_its_own_paths_and_prefixes() -> None:
    assert per_rank_config(_TP_USER, tp_rank=0, tp_size=1) == _TP_USER  # TP 1: unchanged
    r1 = per_rank_config(_TP_USER, tp_rank=1, tp_size=2)
    tiers = r1["tiers"]
    assert tiers[0] == _TP_USER["tiers"][0]
    assert tiers[1]["path"] == "/srv/tc/nvme/tp1of2"
    assert tiers[2]["path"] == "/srv/tc/lmdb/tp1of2"
    assert tiers[3]["prefix"] == "tiercache:tp1of2:"
    assert tiers[4]["prefix"] == "kv:tp1of2:"
    assert _TP_USER["tiers"][1]["path"] == "/srv/tc/nvme"  # the user's mapping is not touched
    with pytest.raises(ValueError):
        per_rank_config(_TP_USER, tp_rank=2, tp_size=2)


def test_resolve_rank_config_same_keys_on_every_rank_own_store_namespace() -> None:
    vc = _vllm_config(parallel_config__tensor_parallel_size=2)
    key_ns = namespace_from_vllm(vc, layout="x", tp_rank=0)
    ranks = [
        resolve_rank_config(
            _TP_USER,
            block_size=32,
            key_namespace=key_ns,
            store_namespace=namespace_from_vllm(vc, layout="x", tp_rank=r),
            tp_rank=r,
            tp_size=2,
        )
        for r in range(2)
    ]
    assert ranks[0].key_namespace == ranks[1].key_namespace == f"team|{key_ns}"
    assert ranks[0].config.namespace != ranks[1].config.namespace
    assert all(r.config.namespace.startswith("team|") for r in ranks)
    # TP 1: keys and store share one namespace, exactly as `resolve_config` gives it.
    one = resolve_rank_config(
        _TP_USER, block_size=32, key_namespace="n", store_namespace="n", tp_rank=0, tp_size=1
    )
    assert one.key_namespace == one.config.namespace == "team|n"
    assert one.config == resolve_config(_TP_USER, block_size=32, namespace="n")


def test_a_user_set_nvme_instance_is_refused_naming_what_sets_it() -> None:
    """The engine's rank decides each NVMe instance: per data-parallel rank, and with head
    shards (`shared`) per (data-parallel, tensor-parallel) rank; the refusal says which."""
    user = {"tiers": [{"kind": "nvme", "path": "/srv/tc/nvme", "blocks": 8, "instance": 1}]}
    args = {"block_size": 16, "key_namespace": "k", "store_namespace": "k"}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.instance: the data-parallel rank"):
        resolve_rank_config(user, **args, tp_rank=0, tp_size=1, dp_rank=0, dp_size=2)
    with pytest.raises(ConfigError, match=r"instance: the \(data-parallel, tensor-parallel\)"):
        resolve_rank_config(user, **args, tp_rank=1, tp_size=2, shared=True)


def test_prepare_rank_dirs_creates_the_users_directory(tmp_path: Path) -> None:
    user = {"tiers": [{"kind": "lmdb", "path": str(tmp_path / "db"), "blocks": 8}]}
    rank = resolve_rank_config(
        user, block_size=16, key_namespace="k", store_namespace="s", tp_rank=1, tp_size=2
    )
    prepare_rank_dirs(rank)
    assert (tmp_path / "db").is_dir() and not (tmp_path / "db" / "tp1of2").exists()
    shared = acquire_store(rank.config, 64)  # the tier creates its own rank directory
    try:
        assert (tmp_path / "db" / "tp1of2").is_dir()
    finally:
        release_store(shared)


def test_per_rank_telemetry_gives_each_rank_its_own_files_and_port() -> None:
    tel = {"dir": "/t/tel", "prometheus": "127.0.0.1:9464"}
    user = {"tiers": [], "telemetry": tel}
    assert per_rank_telemetry(user, tp_rank=0, tp_size=1) == user  # one rank: unchanged
    got = [
        per_rank_telemetry(user, tp_rank=t, tp_size=2, dp_rank=d, dp_size=dp)["telemetry"]
        for dp in (1, 2)
        for d in range(dp)
        for t in range(2)
    ]
    assert [(g["dir"], g["prometheus"]) for g in got] == [
        ("/t/tel/tp0of2", "127.0.0.1:9464"),
        ("/t/tel/tp1of2", "127.0.0.1:9465"),
        ("/t/tel/tp0of2-dp0of2", "127.0.0.1:9464"),
        ("/t/tel/tp1of2-dp0of2", "127.0.0.1:9465"),
        ("/t/tel/tp0of2-dp1of2", "127.0.0.1:9466"),
        ("/t/tel/tp1of2-dp1of2", "127.0.0.1:9467"),
    ]
    dp = per_rank_telemetry(user, tp_rank=0, tp_size=1, dp_rank=1, dp_size=2)["telemetry"]
    assert dp == {"dir": "/t/tel/dp1of2", "prometheus": "127.0.0.1:9465"}
    any_port = {"tiers": [], "telemetry": {"dir": "/t/tel", "prometheus": ":0"}}
    one = per_rank_telemetry(any_port, tp_rank=1, tp_size=2)["telemetry"]
    assert one["prometheus"] == ":0"
    assert user["telemetry"] == tel  # the user's mapping is not changed


def test_tp_ranks_with_telemetry_open_side_by_side(tmp_path: Path) -> None:
    """Two TP ranks with one `[telemetry]` table (Prometheus on): before, the second rank's
    cache failed to open (the port was taken) and both wrote one stats.json."""
    port = free_port(also=1)
    user = {
        "tiers": [{"kind": "cpu", "blocks": 8}],
        "telemetry": {"dir": str(tmp_path / "tel"), "prometheus": f"127.0.0.1:{port}"},
    }
    shared = []
    try:
        for r in range(2):
            rank = resolve_rank_config(
                user, block_size=4, key_namespace="k", store_namespace=f"s{r}", tp_rank=r, tp_size=2
            )
            prepare_rank_dirs(rank)
            shared.append(acquire_store(rank.config, 64))
        served = [s.cache._telemetry.prometheus_port for s in shared]
        assert served == [port, port + 1]
        shared[1].cache.put(shared[1].cache.hash_tokens(list(range(4))), torch.ones((1, 64)).byte())
    finally:
        for s in shared:
            release_store(s)
    stats = [read_stats(tmp_path / "tel" / f"tp{r}of2") for r in range(2)]
    assert [s["namespace"] for s in stats] == ["s0", "s1"]
    assert [s["tiers"]["cpu"]["stored"] for s in stats] == [0, 1]
    # The CLI reads one rank's directory, and every rank when given their parent.
    r = CliRunner().invoke(main, ["stats", str(tmp_path / "tel" / "tp1of2"), "--json"])
    assert r.exit_code == 0 and '"s1"' in r.output, r.output
    r = CliRunner().invoke(main, ["stats", str(tmp_path / "tel")])
    assert r.exit_code == 0 and "rank tp0of2" in r.output and "rank tp1of2" in r.output, r.output


# -- extra keys --------------------------------------------------------------------------------
def test_extra_keys_for_lora_salt_and_multimodal() -> None:
    assert extra_keys_for(block_size=32) is None
    assert extra_keys_for(block_size=32, lora_name="a", cache_salt="s") == {
        0: (("lora", "a"), ("salt", "s"))
    }
    # An image at tokens 40..103 covers blocks 1, 2 and 3.
    got = extra_keys_for(block_size=32, mm_items=[("img", 40, 64)])
    assert got == {b: (("mm", "img", 40),) for b in (1, 2, 3)}
    with pytest.raises(ValueError, match=r"mm_items\[0\]"):
        extra_keys_for(block_size=32, mm_items=[("img", -1, 4)])
    with pytest.raises(ValueError, match="block_size"):
        extra_keys_for(block_size=0)


def test_extra_keys_change_the_keys_they_should() -> None:
    tokens = list(range(128))
    plain = prefix_hashes(tokens, 32, namespace="n")

    def keys(**kw: object) -> list[bytes]:
        return prefix_hashes(
            tokens, 32, namespace="n", extra_keys=extra_keys_for(block_size=32, **kw)
        )

    assert keys() == plain
    # LoRA and salt change every key; another salt gives other keys again.
    salted = keys(cache_salt="s")
    assert all(a != b for a, b in zip(salted, plain, strict=True))
    assert keys(cache_salt="t") != salted and keys(lora_name="l") != salted
    # An image from token 40 keeps block 0 and changes the chain from block 1 on.
    mm = keys(mm_items=[("img", 40, 8)])
    assert mm[0] == plain[0] and all(a != b for a, b in zip(mm[1:], plain[1:], strict=True))
    assert keys(mm_items=[("other", 40, 8)])[1] != mm[1]


# -- shared store registry ---------------------------------------------------------------------
def _cfg(tmp_path: Path, ns: str = "t"):
    user = {
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            {"kind": "lmdb", "path": str(tmp_path / "db"), "blocks": 8},
        ]
    }
    return resolve_config(user, block_size=16, namespace=ns)


def test_acquire_shares_one_cache_per_config_and_last_release_closes(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    assert find_store(cfg) is None
    a = acquire_store(cfg, 64)
    # A second role in this process gets the same cache: the LMDB environment opens once.
    b = acquire_store(_cfg(tmp_path), 64)
    assert a is b and a.refs == 2 and find_store(cfg) is a
    keys = a.cache.hash_tokens(list(range(32)))
    a.cache.put(keys, torch.full((2, 64), 7, dtype=torch.uint8))
    a.count("stored", 2)
    snap = store_snapshots()[cfg.namespace]
    assert snap["counters"] == {"stored": 2} and snap["refs"] == 2
    with pytest.raises(ValueError, match="block_bytes"):
        acquire_store(cfg, 128)
    order: list[str] = []
    a.before_close.append(lambda: order.append("hook"))
    release_store(a)
    assert find_store(cfg) is a and order == []  # still one reference
    release_store(b)
    assert find_store(cfg) is None and order == ["hook"]
    release_store(b)  # releasing again is a no-op
    # Closed means written back and flushed: a new store finds the blocks in LMDB.
    c = acquire_store(cfg, 64)
    try:
        assert c is not a
        assert c.cache.lookup(keys) == 2
        assert torch.equal(c.cache.get(keys), torch.full((2, 64), 7, dtype=torch.uint8))
    finally:
        release_store(c)


def test_other_namespace_is_another_store(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = acquire_store(_cfg(tmp_path / "a", "one"), 64)
    b = acquire_store(_cfg(tmp_path / "b", "two"), 64)
    try:
        assert a is not b
    finally:
        release_store(a)
        release_store(b)


def test_exit_backstop_closes_open_stores_and_runs_hooks(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    s = acquire_store(cfg, 64)
    ran = threading.Event()
    s.before_close.append(ran.set)
    s.before_close.append(lambda: 1 / 0)  # a failing hook does not keep the cache open
    stores._close_all()
    assert ran.is_set() and find_store(cfg) is None
    with pytest.raises(RuntimeError, match="closed"):
        s.cache.lookup([b"\0" * 16])


# -- KV cache groups (vLLM's hybrid KV cache manager) ---------------------------------------
class FullAttentionSpec:  # named as vLLM's spec classes: kv_groups reads names, not types
    def __init__(self, block_size: int = 32, page: int = 8192) -> None:
        self.block_size, self.page_size_bytes = block_size, page


class SlidingWindowSpec(FullAttentionSpec):
    def __init__(self, window: int, block_size: int = 32, extra: int = 0) -> None:
        super().__init__(block_size)
        self.sliding_window, self.extra_retained_tokens = window, extra


class MambaSpec(FullAttentionSpec):
    pass


def _config(*specs: object, layers: int = 2) -> SimpleNamespace:
    groups = [
        SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}.{j}" for j in range(layers)])
        for i, s in enumerate(specs)
    ]
    return SimpleNamespace(kv_cache_groups=groups)


def test_kv_groups_single_group_has_no_name() -> None:
    # One group: the plain prefix keys (group name ""), as before hybrid support.
    (g,) = kv_groups(_config(FullAttentionSpec(), layers=6))
    assert (g.name, g.kind, g.window_blocks, g.block_bytes) == ("", "full_attention", 0, 6 * 8192)


def test_kv_groups_hybrid_names_kinds_and_windows() -> None:
    groups = kv_groups(_config(SlidingWindowSpec(64), SlidingWindowSpec(64), FullAttentionSpec()))
    assert [g.kind for g in groups] == ["sliding_window"] * 2 + ["full_attention"]
    assert [g.window_blocks for g in groups] == [2, 2, 0]
    assert groups[0].name == "sliding_window/64/l0.0,l0.1"
    assert len({g.name for g in groups}) == 3
    # vLLM's retained tokens (e.g. speculative lookahead) widen the window.
    (_, g) = kv_groups(_config(FullAttentionSpec(), SlidingWindowSpec(64, extra=8)))
    assert g.window_blocks == 3


def test_kv_groups_refuses_non_attention_and_mixed_blocks() -> None:
    with pytest.raises(ValueError, match="MambaSpec"):
        kv_groups(_config(FullAttentionSpec(), MambaSpec()))
    with pytest.raises(ValueError, match="block sizes"):
        kv_groups(_config(FullAttentionSpec(), SlidingWindowSpec(64, block_size=16)))


def test_hit_end_is_the_longest_prefix_every_group_serves() -> None:
    groups = kv_groups(_config(SlidingWindowSpec(64), FullAttentionSpec()))
    held = {(0, 3), (0, 4)}  # the sliding group holds blocks 3 and 4 only
    has = lambda g, p: (g, p) in held  # noqa: E731
    assert hit_end(groups, 0, 7, has) == 5  # the window before block 5 is blocks 3, 4
    assert hit_end(groups, 0, 4, has) == 0  # before block 4 it needs 2, 3: no hit
    assert list(window_positions(groups[0], 0, 5)) == [3, 4]
    assert list(window_positions(groups[1], 2, 5)) == [2, 3, 4]
    assert hit_end(groups, 4, 5, has) == 5  # block 3 is before the start: vLLM holds it
