"""The choice of block layout across TP sizes (connectors/tp_layout.py) and block events from
head shards' events (connectors/vllm_kv/shard_events.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from tiercache.config import CacheConfig
from tiercache.connectors.tp_layout import (
    blocks_as_shards,
    check_no_rank_dirs,
    choose_shards,
    read_tp_layout,
)
from tiercache.errors import ConfigError
from tiercache.transfer.head_shards import HeadShards


class FullAttentionSpec(SimpleNamespace):
    pass


class MLAAttentionSpec(SimpleNamespace):
    pass


def _spec(heads: int = 4, **kw: object) -> FullAttentionSpec:
    fields: dict[str, object] = {"page_size_padded": None, "num_head_slots": None, **kw}
    return FullAttentionSpec(num_kv_heads=heads, **fields)


def _choose(extra: dict | None = None, *, tp: int = 1, rank: int = 0, total: int = 4, **kw):
    args = {
        "spec": _spec(total // tp),
        "groups": 1,
        "kv_cache_layout": "LBHNC",
        "total_kv_heads": total,
        "tp_size": tp,
        "tp_rank": rank,
    }
    args.update(kw)
    return choose_shards(extra, **args)


def test_auto_shards_by_the_largest_power_of_two_dividing_the_kv_heads() -> None:
    assert _choose() == HeadShards(4, 1, 0)
    assert _choose(tp=2, rank=1) == HeadShards(4, 2, 1)
    assert _choose(total=6, tp=2) == HeadShards(2, 2, 0)
    assert _choose(total=32, tp=4, rank=3) == HeadShards(8, 4, 3)
    assert _choose({"max_tp": 2}, total=8) == HeadShards(2, 1, 0)
    assert _choose({"tp_layout": "rank"}) is None


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"groups": 2}, "hybrid model"),
        ({"spec": MLAAttentionSpec(num_kv_heads=1)}, "no KV heads"),
        ({"spec": _spec(4, page_size_padded=1 << 20)}, "padded or packed"),
        ({"kv_cache_layout": "LBNHC"}, "not LBHNC"),
        ({"kv_cache_layout": None}, "not named"),
        ({"total": 6, "tp": 3, "spec": _spec(2)}, "does not divide 2 head shards"),
    ],
)
def test_auto_keeps_one_store_per_rank_where_shards_cannot_be_and_says_why(
    kw: dict, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "tiercache.connectors.tp_layout"):
        assert _choose(**kw) is None
    assert why in caplog.text
    with pytest.raises(ConfigError, match=r"tp_layout|max_tp") as e:
        _choose({"tp_layout": "heads"}, **kw)
    assert e.value.field.startswith("kv_connector_extra_config.")


def test_heads_replicated_by_a_tp_size_above_the_kv_heads_are_no_shards() -> None:
    # TP 4 over 2 KV heads: vLLM gives each rank one head (replicas)
    assert _choose(total=2, tp=4, spec=_spec(1)) is None
    with pytest.raises(ConfigError, match="replicates the model's 2 KV heads"):
        _choose({"tp_layout": "heads"}, total=2, tp=4, spec=_spec(1))


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"tp_layout": "heads", "max_tp": 3}, "3 does not divide the model's 4 KV heads"),
        ({"max_tp": 3}, "3 does not divide"),
        ({"max_tp": 1, "tp_layout": "auto"}, "TP size 2 does not divide 1 head shards"),
        ({"tp_layout": "both"}, "expected one of"),
        ({"max_tp": 0}, "expected an int >= 1"),
        ({"max_tp": True}, "expected an int >= 1"),
    ],
)
def test_a_max_tp_or_tp_layout_that_cannot_be_used_is_refused(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _choose(extra, tp=2)


def test_read_tp_layout_defaults() -> None:
    assert read_tp_layout(None) == ("auto", None)
    assert read_tp_layout({"tp_layout": "heads", "max_tp": 4}) == ("heads", 4)


def test_a_head_shard_store_refuses_a_path_of_per_rank_stores(tmp_path: Path) -> None:
    nvme, lmdb = tmp_path / "nvme", tmp_path / "lmdb"
    (nvme / "tp0of2").mkdir(parents=True)
    (nvme / "tp1of2").mkdir()
    lmdb.mkdir()
    cfg = CacheConfig.from_mapping(
        {
            "block_size": 4,
            "tiers": [
                {"name": "cpu", "kind": "cpu", "capacity": "1MiB"},
                {"name": "lmdb", "kind": "lmdb", "capacity": "1MiB", "path": str(lmdb)},
                {"name": "nvme", "kind": "nvme", "capacity": "1MiB", "path": str(nvme)},
            ],
        }
    )
    with pytest.raises(ConfigError, match=r"tp0of2, tp1of2.*tp_layout = 'rank'") as e:
        check_no_rank_dirs(cfg)
    assert e.value.field == "tiers[2].path"
    # nothing of the old stores was touched
    assert sorted(p.name for p in nvme.iterdir()) == ["tp0of2", "tp1of2"]
    (nvme / "tp0of2").rmdir()
    (nvme / "tp1of2").rmdir()
    check_no_rank_dirs(cfg)  # plain directories pass


# -- block events from shard events ---------------------------------------------------------
def test_a_block_is_stored_once_every_shard_is_and_removed_once_one_leaves() -> None:
    from tiercache.connectors.shard_events import ShardEvents

    shards = HeadShards(4, 2, 0)
    ev = ShardEvents(shards)
    blocks = [bytes([i]) * 16 for i in range(3)]
    ev.expect(blocks)
    r0 = HeadShards(4, 2, 0).keys(blocks)
    r1 = HeadShards(4, 2, 1).keys(blocks)
    assert ev.apply(r0, "CPU", False) == []  # rank 0's half: no block whole yet
    assert ev.apply(r1[:2], "CPU", False) == [blocks[0]]
    assert ev.apply(r1[2:], "CPU", False) == blocks[1:]
    assert ev.apply(r1[:2], "CPU", False) == []  # again: no second event
    assert ev.apply(r0[:1], "LMDB", False) == []  # another medium counts apart
    assert ev.apply([r0[0], r0[1]], "CPU", True) == [blocks[0]]
    assert ev.apply([r1[0]], "CPU", True) == []  # already announced removed
    assert ev.apply([b"\x09" * 16], "CPU", False) == []  # unknown keys: no events


def test_shards_stored_before_their_blocks_are_known_are_announced_once_they_are() -> None:
    from tiercache.connectors.shard_events import ShardEvents

    shards = HeadShards(2)
    ev = ShardEvents(shards)
    a, b = bytes([1]) * 16, bytes([2]) * 16
    ka, kb = shards.keys([a]), shards.keys([b])
    # recovered at start-up (the handshake): a whole in LMDB and CPU, b half in LMDB
    assert ev.apply(ka + kb[:1], "LMDB", False) == []
    assert ev.apply(ka, "CPU", False) == []
    assert ev.apply(ka[:1], "CPU", True) == []  # one of a's shards left the CPU tier
    assert ev.expect([a, b]) == {"LMDB": [a]}
    assert ev.expect([a, b]) == {}  # once
    assert ev.apply(kb[1:], "LMDB", False) == [b]
    assert ev.apply(ka[1:], "LMDB", True) == [a]


def test_shard_events_forget_the_oldest_blocks_past_their_bound() -> None:
    from tiercache.connectors.shard_events import ShardEvents

    ev = ShardEvents(HeadShards(2), cap=4)
    a, b, c = (bytes([i]) * 16 for i in range(3))
    ev.expect([a, b])
    ev.expect([c])  # a's two shard keys out
    assert ev.apply(HeadShards(2).keys([a]), "CPU", False) == []
    assert ev.apply(HeadShards(2).keys([c]), "CPU", False) == [c]
    assert ev.take_forgotten() == {}  # a was whole nowhere


def test_a_block_past_the_bound_is_forgotten_whole_and_announced_removed() -> None:
    """A bound that cuts through a block's shard keys forgets the whole block; one announced
    whole is announced removed, since its later removal could not be seen any more."""
    from tiercache.connectors.shard_events import ShardEvents

    shards = HeadShards(4)
    ev = ShardEvents(shards, cap=6)
    a, b = bytes([1]) * 16, bytes([2]) * 16
    ka, kb = shards.keys([a]), shards.keys([b])
    ev.expect([a])
    assert ev.apply(ka, "CPU", False) == [a]
    assert ev.apply(ka[:2], "LMDB", False) == []  # half of a in LMDB: never announced there
    ev.expect([b])  # 8 keys past a bound of 6: a's first two out, so all of a goes
    assert ev.take_forgotten() == {"CPU": [a]}
    assert ev.take_forgotten() == {}  # once
    # a's shards are unmapped now, all of them: events wait for a's next lookup and replay.
    assert ev.apply(ka[3:], "CPU", True) == []
    assert ev.apply(kb, "CPU", False) == [b]
    assert ev.expect([a]) == {}  # what a held was forgotten with it
    assert ev.take_forgotten() == {"CPU": [b]}  # mapping a again pushed b out the same way
    assert ev.apply(ka, "LMDB", False) == [a]  # a's keys map to a again, all of them


def test_a_tiers_blocks_keep_counting_engine_blocks() -> None:
    user = {
        "tiers": [
            {"kind": "cpu", "blocks": 8},
            {"kind": "nvme", "blocks": 8},
            {"kind": "lmdb", "blocks": 8},
            {"kind": "redis", "blocks": 8},
            {"kind": "lmdb", "capacity": "1MiB"},
            {"kind": "nosuch", "blocks": 8},
        ]
    }
    out = blocks_as_shards(user, HeadShards(4, 2, 1))
    # This rank's 2 shards per block in its own tiers and in Redis's index of what it
    # stored; all 4 in LMDB, whose capacity bounds the store every rank writes to.
    assert [t.get("blocks") for t in out["tiers"]] == [16, 16, 32, 16, None, 16]
    assert out["tiers"][4] == {"kind": "lmdb", "capacity": "1MiB"}
    assert user["tiers"][0]["blocks"] == 8  # the caller's mapping is not changed
    assert blocks_as_shards({"tiers": "bad"}, HeadShards(2)) == {"tiers": "bad"}


def test_tp1_and_tp2_engines_give_one_lmdb_store_the_same_capacity(tmp_path: Path) -> None:
    """Every rank of every TP size opens the shared LMDB store with the same capacity, and
    the store keeps `blocks` engine blocks of every rank's shards: TP=2 kept half before."""
    from tiercache.tiers import build_tier

    user = {"tiers": [{"kind": "lmdb", "path": str(tmp_path / "lmdb"), "blocks": 6}]}
    caps = {
        (tp, r): blocks_as_shards(user, HeadShards(4, tp, r))["tiers"][0]["blocks"]
        for tp in (1, 2, 4)
        for r in range(tp)
    }
    assert set(caps.values()) == {24}, caps
    cfg = CacheConfig.from_mapping(blocks_as_shards(user, HeadShards(4, 2, 0)))
    tier = build_tier(cfg.tiers[0], block_bytes=64, namespace="heads-test")
    try:
        assert tier.capacity_blocks == 24
    finally:
        tier.close()
