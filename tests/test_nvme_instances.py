"""Replicas and data-parallel ranks on one host given one config (issue 15, item 4): the NVMe
tier's `instances` and `instance` options, and `per_dp_rank_config`, with real processes
opening one configured path at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.campaign_support import repo_env
from tiercache import CacheConfig, TierCache
from tiercache.cli import main
from tiercache.connectors.ranks import per_dp_rank_config, resolve_rank_config
from tiercache.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
BB = 4096

# A replica: opens the cache from a JSON config (argv[1]), stores the 4 blocks of prompt
# argv[2] (if not held yet), reports which NVMe instance it opened, how many of its blocks it
# found at open and the hit count for its prompt, then waits for a line on stdin and closes.
REPLICA = """
import json, sys, torch
from tiercache import TierCache
from tiercache.connectors.common import resolve_rank_config
cfg, tag = json.loads(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) > 3:  # a data-parallel rank: "rank/size"
    r, n = map(int, sys.argv[3].split("/"))
    cfg = resolve_rank_config(cfg, block_size=16, key_namespace="m", store_namespace="m",
                              tp_rank=0, tp_size=1, dp_rank=r, dp_size=n).config
with TierCache.open(cfg, block_bytes=4096) as c:
    nv = [t for t in c.tiers if t.kind == "nvme"][0]
    keys = c.hash_tokens([tag] * 64)
    found = c.lookup(keys)
    if found < 4:
        c.put(keys, torch.full((4, 4096), tag, dtype=torch.uint8))
    got = c.get(keys)
    ok = bool((got == tag).all()) and len(got) == 4
    print(json.dumps({"path": nv.path, "instance": nv.instance, "found": found, "ok": ok}),
          flush=True)
    sys.stdin.readline()
"""


class Replica:
    """A replica process, open until `stop()`."""

    def __init__(self, cfg: dict, tag: int, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", REPLICA, json.dumps(cfg), str(tag), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=repo_env(),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(self.proc.communicate(timeout=60)[1])
        self.report = json.loads(line)

    def stop(self) -> None:
        self.proc.communicate("\n", timeout=60)
        assert self.proc.returncode == 0


def config(path: Path, **nvme: object) -> dict:
    return {
        "namespace": "m",
        "tiers": [{"kind": "nvme", "path": str(path), "blocks": 16, "direct": False, **nvme}],
    }


def test_replicas_with_one_config_take_their_own_instance_and_get_it_back(tmp_path: Path) -> None:
    store = tmp_path / "nvme"
    cfg = config(store, instances=3)
    # Two replicas open the one configured path at once: the first takes the path itself,
    # the second finds it held and takes instance 1.
    a, b = Replica(cfg, 1), Replica(cfg, 2)
    try:
        assert (a.report["instance"], a.report["path"]) == (0, str(store))
        assert (b.report["instance"], b.report["path"]) == (1, str(store / "instance1"))
        assert a.report["ok"] and b.report["ok"] and a.report["found"] == b.report["found"] == 0
        # B restarts while A runs: it takes instance 1 back and finds its 4 blocks there.
        b.stop()
        b = Replica(cfg, 2)
        assert b.report == {"path": str(store / "instance1"), "instance": 1, "found": 4, "ok": True}
        # A third replica gets instance 2; a fourth finds every instance held.
        c = Replica(cfg, 3)
        assert c.report["instance"] == 2
        with pytest.raises(AssertionError, match=r"tiers\[0\]\.path: .*all 3 instances are in use"):
            Replica(cfg, 4)
        c.stop()
    finally:
        a.stop()
        b.stop()
    # `tiercache inspect` on the config shows every instance as a store of its own.
    toml = tmp_path / "c.toml"
    toml.write_text(
        f'namespace = "m"\n[[tiers]]\nkind = "nvme"\npath = "{store}"\nblocks = 16\ninstances = 3\n'
    )
    r = CliRunner().invoke(main, ["inspect", str(toml), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["tiers"]
    assert [(t["instance"], t["path"], t["blocks"]) for t in rows] == [
        (0, str(store), 4),
        (1, str(store / "instance1"), 4),
        (2, str(store / "instance2"), 4),
    ]
    r = CliRunner().invoke(main, ["clear", str(toml), "--yes", "--json"])
    assert json.loads(r.stdout) == {
        "dropped": {"nvme": 4, "nvme/instance1": 4, "nvme/instance2": 4}
    }


def test_without_instances_a_second_process_is_refused_and_the_layout_is_unchanged(
    tmp_path: Path,
) -> None:
    store = tmp_path / "nvme"
    a = Replica(config(store), 1)
    try:
        with pytest.raises(AssertionError, match=r"tiers\[0\]\.path: .* is in use by another"):
            Replica(config(store), 2)
    finally:
        a.stop()
    assert sorted(p.name for p in store.iterdir()) == ["index", "index.img", "meta.json", "slab"]
    # A store made without the option opens as before, blocks and all, once it is switched on.
    a = Replica(config(store, instances=2), 1)
    try:
        assert a.report == {"path": str(store), "instance": 0, "found": 4, "ok": True}
    finally:
        a.stop()


def test_data_parallel_ranks_share_lmdb_and_keep_their_own_nvme_instance(tmp_path: Path) -> None:
    cfg = {
        "namespace": "team",
        "tiers": [
            {"kind": "nvme", "path": str(tmp_path / "nvme"), "blocks": 16, "direct": False},
            {
                "kind": "lmdb",
                "path": str(tmp_path / "lmdb"),
                "blocks": 64,
                "write_policy": "write-through",
            },
        ],
    }
    r0, r1 = Replica(cfg, 1, "0/2"), Replica(cfg, 2, "1/2")
    try:
        assert (r0.report["instance"], r0.report["path"]) == (0, str(tmp_path / "nvme"))
        assert (r1.report["instance"], r1.report["path"]) == (1, str(tmp_path / "nvme/instance1"))
    finally:
        r0.stop()
        r1.stop()
    # Rank 1 restarts alone: its NVMe instance is its own; rank 0's prompt is found too, in the
    # shared LMDB store (one namespace for every rank).
    r1 = Replica(cfg, 1, "1/2")
    try:
        assert r1.report == {
            "path": str(tmp_path / "nvme/instance1"),
            "instance": 1,
            "found": 4,
            "ok": True,
        }
    finally:
        r1.stop()


def test_per_dp_rank_config_sets_only_the_nvme_instance() -> None:
    user = {
        "namespace": "team",
        "tiers": [
            {"kind": "cpu", "blocks": 8},
            {"kind": "nvme", "path": "/srv/nvme", "blocks": 8, "instances": 4},
            {"kind": "lmdb", "path": "/srv/lmdb", "blocks": 8},
            {"kind": "redis", "url": "redis://h:6379/0", "blocks": 8},
        ],
    }
    assert per_dp_rank_config(user, dp_rank=0, dp_size=1) == user  # DP 1: unchanged
    r1 = per_dp_rank_config(user, dp_rank=1, dp_size=2)
    assert r1["tiers"][1] == {**user["tiers"][1], "instance": 1}
    assert [r1["tiers"][i] for i in (0, 2, 3)] == [user["tiers"][i] for i in (0, 2, 3)]
    assert "instance" not in user["tiers"][1]  # the user's mapping is not touched
    with pytest.raises(ValueError, match="dp_rank"):
        per_dp_rank_config(user, dp_rank=2, dp_size=2)
    pinned = {"tiers": [{"kind": "nvme", "path": "/p", "blocks": 8, "instance": 0}]}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.instance: the data-parallel rank"):
        per_dp_rank_config(pinned, dp_rank=0, dp_size=2)
    pinned = {"tiers": [{"kind": "nvme", "path": "/p", "blocks": 8, "instance_env": "R"}]}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.instance_env: the data-parallel"):
        per_dp_rank_config(pinned, dp_rank=0, dp_size=2)
    # Under TP the instance is one of the rank's own directory; namespaces as without DP.
    rank = resolve_rank_config(
        user,
        block_size=16,
        key_namespace="k",
        store_namespace="s",
        tp_rank=1,
        tp_size=2,
        dp_rank=1,
        dp_size=2,
    )
    nvme = rank.config.tiers[1].options
    assert (nvme["path"], nvme["instance"]) == ("/srv/nvme/tp1of2", 1)
    assert rank.config.namespace == "team|s" and rank.key_namespace == "team|k"
    assert (rank.dp_rank, rank.dp_size) == (1, 2)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"instances": 0}, "instances"),
        ({"instances": -1}, "instances"),
        ({"instances": 257}, "instances"),
        ({"instances": True}, "instances"),
        ({"instances": "2"}, "instances"),
        ({"instance": -1}, "instance"),
        ({"instance": 256}, "instance"),
        ({"instance": "env:RANK"}, "instance"),
        ({"instance": False}, "instance"),
        ({"instance_env": "NOT A NAME"}, "instance_env"),
        ({"instance_env": 3}, "instance_env"),
        ({"instance_env": "TC_TEST_INSTANCE", "instance": 1}, "instance_env"),
        ({"instance_env": "TC_TEST_BAD_INSTANCE"}, "instance_env"),  # set to "two" below
        ({"instance_env": "TC_TEST_BIG_INSTANCE"}, "instance_env"),  # set to "256" below
    ],
)
def test_bad_instance_options_name_the_field(
    tmp_path: Path, options: dict, field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TC_TEST_BAD_INSTANCE", "two")
    monkeypatch.setenv("TC_TEST_BIG_INSTANCE", "256")
    with pytest.raises(ConfigError, match=rf"^tiers\[0\]\.{field}: "):
        CacheConfig.from_mapping(config(tmp_path / "nvme", **options))
    assert not (tmp_path / "nvme").exists()


def test_an_explicit_instance_opens_that_one_only(tmp_path: Path) -> None:
    store = tmp_path / "nvme"
    with TierCache.open(config(store, instance=2), block_bytes=BB) as c:
        assert (c.tiers[0].path, c.tiers[0].instance) == (str(store / "instance2"), 2)
        with pytest.raises(ConfigError, match=r"tiers\[0\]\.path: .*\(instance 2\) is in use"):
            TierCache.open(config(store, instance=2), block_bytes=BB)
    assert sorted(p.name for p in store.iterdir()) == ["instance2"]  # only its directory


def test_instance_env_opens_the_instance_its_variable_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "nvme"
    cfg = config(store, instance_env="TC_TEST_INSTANCE", instances=2)
    monkeypatch.setenv("TC_TEST_INSTANCE", " 3 ")
    with TierCache.open(cfg, block_bytes=BB) as c:
        assert (c.tiers[0].path, c.tiers[0].instance) == (str(store / "instance3"), 3)
    # Unset: as without the option (here: the first free of 2 instances).
    monkeypatch.delenv("TC_TEST_INSTANCE")
    with TierCache.open(cfg, block_bytes=BB) as c, TierCache.open(cfg, block_bytes=BB) as d:
        assert (c.tiers[0].instance, d.tiers[0].instance) == (0, 1)
