"""Config schema: valid forms, sizes, and a catalogue of bad inputs whose errors name the field."""

from __future__ import annotations

import pytest

from tiercache import CacheConfig, ConfigError, TierCache
from tiercache.config import parse_size

BASE = {
    "block_size": 16,
    "namespace": "m/bf16/tp1/0",
    "tiers": [{"kind": "cpu", "capacity": "1MiB", "policy": "arc"}],
}


def with_tier(**fields) -> dict:
    tier = {"kind": "cpu", "capacity": "1MiB", **fields}
    return {**BASE, "tiers": [{k: v for k, v in tier.items() if v is not None}]}


@pytest.mark.parametrize(
    "text,expected",
    [
        ("256MiB", 256 * 2**20),
        ("1GiB", 2**30),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        (" 2 KiB ", 2048),
        ("10kb", 10_000),
        (123, 123),
        ("3TiB", 3 * 2**40),
    ],
)
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


def test_valid_mapping_and_defaults() -> None:
    c = CacheConfig.from_mapping(BASE)
    assert (c.block_size, c.namespace, c.promote) == (16, "m/bf16/tp1/0", True)
    (t,) = c.tiers
    assert (t.kind, t.name, t.policy, t.capacity_bytes) == ("cpu", "cpu", "arc", 2**20)
    assert t.capacity_in_blocks(4096) == 256
    c2 = CacheConfig.from_mapping({"tiers": [{"kind": "cpu", "blocks": 7}]})
    assert c2.tiers[0].capacity_in_blocks(10**9) == 7 and c2.tiers[0].policy == "lru"


def test_dotted_policy_path() -> None:
    c = CacheConfig.from_mapping(with_tier(policy="tiercache.policies.lru.LRUPolicy"))
    assert c.tiers[0].policy.endswith("LRUPolicy")


BAD = [
    ({**BASE, "block_size": 0}, "block_size"),
    ({**BASE, "block_size": "16"}, "block_size"),
    ({**BASE, "block_size": True}, "block_size"),
    ({**BASE, "namespace": ""}, "namespace"),
    ({**BASE, "namespace": 5}, "namespace"),
    ({**BASE, "promote": "yes"}, "promote"),
    ({**BASE, "tiers": []}, "tiers"),
    ({**BASE, "tiers": "cpu"}, "tiers"),
    ({**BASE, "tiers": ["cpu"]}, r"tiers\[0\]"),
    ({**BASE, "colour": "blue"}, "colour"),
    (with_tier(kind="tape"), r"tiers\[0\].kind"),
    (with_tier(kind=None), r"tiers\[0\].kind"),
    (with_tier(policy="fifo"), r"tiers\[0\].policy"),
    (with_tier(policy="os.path.join"), r"tiers\[0\].policy"),
    (with_tier(capacity="-5MiB"), r"tiers\[0\].capacity"),
    (with_tier(capacity=0), r"tiers\[0\].capacity"),
    (with_tier(capacity="lots"), r"tiers\[0\].capacity"),
    (with_tier(capacity="5 parsecs"), r"tiers\[0\].capacity"),
    (with_tier(capacity=1.5), r"tiers\[0\].capacity"),
    (with_tier(capacity=None), r"tiers\[0\].capacity"),
    (with_tier(blocks=10), r"tiers\[0\].capacity"),
    (with_tier(capacity=None, blocks=0), r"tiers\[0\].blocks"),
    (with_tier(capacity=None, blocks="10"), r"tiers\[0\].blocks"),
    (with_tier(name="has space"), r"tiers\[0\].name"),
    (with_tier(name="GPU"), r"tiers\[0\].name"),
    (with_tier(pin_memory="yes"), r"tiers\[0\].pin_memory"),
    (with_tier(path="/tmp/x"), r"tiers\[0\].path"),
    (with_tier(kind="gpu", device=3), r"tiers\[0\].device"),
    ({**BASE, "tiers": [BASE["tiers"][0], BASE["tiers"][0]]}, r"tiers\[1\].name"),
]


@pytest.mark.parametrize("mapping,field", BAD)
def test_bad_config_names_the_field(mapping, field) -> None:
    with pytest.raises(ConfigError, match=f"^{field}"):
        CacheConfig.from_mapping(mapping)
    with pytest.raises(ValueError):  # ConfigError is a ValueError
        TierCache.open(mapping, block_bytes=4096)


def test_toml_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        CacheConfig.from_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("block_size = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        CacheConfig.load(bad)
    with pytest.raises(ConfigError, match="expected a CacheConfig"):
        CacheConfig.load(42)  # type: ignore[arg-type]


def test_capacity_smaller_than_a_block() -> None:
    c = CacheConfig.from_mapping(with_tier(capacity="1KiB"))
    with pytest.raises(ConfigError, match=r"tiers\[0\].capacity.*no block"):
        c.tiers[0].capacity_in_blocks(4096)
