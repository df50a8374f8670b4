"""Typed, validated configuration: `CacheConfig` and one `TierConfig` per tier.

Primitives:
- `CacheConfig.load(source)`: a `CacheConfig`, a mapping, or a path to a TOML file.
- `CacheConfig.from_mapping(m)` / `CacheConfig.from_toml(path)`.
- `parse_size("256MiB") -> int`: bytes from an int or a string with a unit.
- `read_toml(path) -> dict`: a TOML file's mapping, unvalidated.
- `TierConfig.capacity_in_blocks(block_bytes)`: the tier's capacity in blocks.

Everything is validated once, here; every error is a `ConfigError` (a `ValueError`) whose
message starts with the offending field, e.g. ``tiers[1].capacity: ...``.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tiercache.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
LOADING_MODES = ("auto", "always", "never")
_TIER_COMMON_KEYS = {"kind", "name", "capacity", "blocks", "policy", "write_policy", "admit"}
WRITE_POLICIES = ("write-back", "write-through")
ADMISSIONS = ("always", "on-reuse")


def parse_size(value: object, field_name: str = "capacity") -> int:
    """Bytes from an int or a string such as "256MiB", "1.5GB", "4096"."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            field_name,
            f"expected bytes as an int or a string like '256MiB', got {type(value).__name__}",
        )
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                field_name,
                f"cannot parse size {value!r}; use e.g. '256MiB', "
                "'2GiB', '500MB' or a number of bytes",
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ConfigError(field_name, f"must be positive, got {value!r}")
    return n


def read_toml(path: str | Path) -> dict[str, Any]:
    """The mapping in a TOML file; `ConfigError` naming ``config`` when it cannot be read."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("config", f"no such file: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("config", f"cannot read {p}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{p} is not valid TOML: {exc}") from None


def _expect(value: object, kind: type | tuple[type, ...], field_name: str, what: str) -> Any:
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(field_name, f"expected {what}, got bool")
    if not isinstance(value, kind):
        raise ConfigError(field_name, f"expected {what}, got {type(value).__name__}")
    return value


def _one_of(value: object, choices: tuple[str, ...], field_name: str) -> None:
    if value not in choices:
        listed = ", ".join(map(repr, choices))
        raise ConfigError(field_name, f"expected one of {listed}, got {value!r}")


def _table(m: object, name: str, known: set[str]) -> Mapping[str, Any]:
    """`m` as the table `name`, whose settings are all in `known`; ConfigError otherwise."""
    if not isinstance(m, Mapping):
        raise ConfigError(name, f"expected a table, got {type(m).__name__}")
    unknown = sorted(set(m) - known)
    if unknown:
        listed = ", ".join(sorted(known))
        raise ConfigError(f"{name}.{unknown[0]}", f"unknown setting; known: {listed}")
    return m


@dataclass(frozen=True)
class TelemetryConfig:
    """The `[telemetry]` table: where and how often a running cache reports."""

    dir: str
    interval: float = 1.0
    events: bool = True
    max_event_bytes: int = 16 * 2**20
    prometheus: str | None = None

    @classmethod
    def from_mapping(cls, m: object) -> TelemetryConfig:
        """Validate a `[telemetry]` table; ConfigError naming the field."""
        m = _table(m, "telemetry", _TELEMETRY_KEYS)
        d = m.get("dir")
        if not isinstance(d, str) or not d:
            raise ConfigError("telemetry.dir", "required: a directory for stats.json and events")
        interval = m.get("interval", 1.0)
        if (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not 0.01 <= interval <= 3600
        ):
            raise ConfigError(
                "telemetry.interval", f"expected seconds in 0.01..3600, got {interval!r}"
            )
        events = m.get("events", True)
        if not isinstance(events, bool):
            raise ConfigError("telemetry.events", f"expected true or false, got {events!r}")
        max_bytes = parse_size(m.get("max_event_bytes", 16 * 2**20), "telemetry.max_event_bytes")
        prom = m.get("prometheus")
        if prom is not None:
            split_addr(prom, "telemetry.prometheus")
        return cls(d, float(interval), events, max_bytes, prom)


@dataclass(frozen=True)
class DeadlineConfig:
    """The `[deadlines]` table: how long an engine waits for a load or a store, and the
    circuit breaker.

    A load into the engine not finished `load_timeout` seconds after the engine started
    waiting for it is abandoned (its blocks are recomputed) and its tier is suspended for
    `backoff` seconds, doubling per repeated miss up to `backoff_max`. A store that has not
    read its blocks out of the engine `store_timeout` seconds after it started is abandoned
    too: the engine gets its blocks back (what was not read is not stored), and its tier is
    suspended the same way."""

    load_timeout: float = 5.0
    store_timeout: float = 10.0
    backoff: float = 1.0
    backoff_max: float = 30.0

    def __post_init__(self) -> None:
        for name in ("load_timeout", "store_timeout", "backoff", "backoff_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 3600:
                raise ConfigError(f"deadlines.{name}", f"expected seconds in (0, 3600], got {v!r}")
        if self.backoff > self.backoff_max:
            raise ConfigError(
                "deadlines.backoff",
                f"must not exceed backoff_max ({self.backoff_max}), got {self.backoff}",
            )

    @classmethod
    def from_mapping(cls, m: object) -> DeadlineConfig:
        """Validate a `[deadlines]` table; ConfigError naming the field."""
        return cls(**_table(m, "deadlines", _DEADLINE_KEYS))


@dataclass(frozen=True)
class LoadingConfig:
    """The `[loading]` table: whether an engine loads a hit or recomputes it (`costs`).

    "auto" loads the leading part of a hit whose estimated load time, times `margin`, is
    below the engine's estimated time to recompute it (measured as the engine runs; before
    the first measurement everything is loaded); "always" (the default) loads every hit;
    "never" none."""

    mode: str = "always"
    margin: float = 1.0

    def __post_init__(self) -> None:
        _one_of(self.mode, LOADING_MODES, "loading.mode")
        m = self.margin
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 < m <= 100:
            raise ConfigError("loading.margin", f"expected a factor in (0, 100], got {m!r}")

    @classmethod
    def from_mapping(cls, m: object) -> LoadingConfig:
        """Validate a `[loading]` table; ConfigError naming the field."""
        return cls(**_table(m, "loading", _LOADING_KEYS))


def split_addr(value: object, field: str) -> tuple[str, int]:
    """("127.0.0.1", 9464) from "127.0.0.1:9464" or ":9464" (loopback)."""
    host, colon, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not colon or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(field, f"expected 'host:port' (e.g. '127.0.0.1:9464'), got {value!r}")
    return host or "127.0.0.1", int(port)


@dataclass(frozen=True)
class TierConfig:
    """One tier: its kind, name (the event medium), capacity, policy and kind-specific options."""

    kind: str
    name: str
    policy: str = "lru"
    capacity_bytes: int | None = None
    capacity_blocks: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    index: int = 0
    write_policy: str | None = None  # None: the default, see CacheConfig.write_through
    admit: str = "always"  # "on-reuse": only blocks sighted twice enter this tier

    @property
    def field(self) -> str:
        """The config path of this tier, for error messages."""
        return f"tiers[{self.index}]"

    def capacity_in_blocks(self, block_bytes: int) -> int:
        """Capacity in whole blocks of `block_bytes`; at least one block or a ConfigError."""
        if self.capacity_blocks is not None:
            return self.capacity_blocks
        assert self.capacity_bytes is not None
        n = self.capacity_bytes // block_bytes
        if n < 1:
            raise ConfigError(
                f"{self.field}.capacity",
                f"{self.capacity_bytes} bytes hold no block of {block_bytes} bytes",
            )
        return n

    @classmethod
    def from_mapping(cls, m: object, index: int) -> TierConfig:
        """Validate one `[[tiers]]` table."""
        where = f"tiers[{index}]"
        if not isinstance(m, Mapping):
            raise ConfigError(where, f"expected a table, got {type(m).__name__}")
        kind = _expect(m.get("kind"), str, f"{where}.kind", "a tier kind string")
        from tiercache.tiers import tier_class  # lazy: the registry imports tier modules on use

        tier_cls = tier_class(kind, f"{where}.kind")
        name = _expect(m.get("name", kind), str, f"{where}.name", "a string")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ConfigError(f"{where}.name", f"{name!r} must be 1-64 letters, digits, '_.-'")
        if name == "GPU":
            raise ConfigError(f"{where}.name", "'GPU' is reserved for the engine's own KV cache")
        policy = _expect(m.get("policy", "lru"), str, f"{where}.policy", "a policy name")
        from tiercache.policies import get_policy_class

        try:
            get_policy_class(policy)
        except ValueError as exc:
            raise ConfigError(f"{where}.policy", str(exc)) from None
        has_cap, has_blocks = "capacity" in m, "blocks" in m
        if has_cap == has_blocks:
            raise ConfigError(
                f"{where}.capacity",
                "give exactly one of 'capacity' (bytes, e.g. '256MiB') or 'blocks'",
            )
        cap_bytes = parse_size(m["capacity"], f"{where}.capacity") if has_cap else None
        cap_blocks = None
        if has_blocks:
            cap_blocks = _expect(m["blocks"], int, f"{where}.blocks", "an int")
            if cap_blocks < 1:
                raise ConfigError(f"{where}.blocks", f"must be >= 1, got {cap_blocks}")
        write_policy = m.get("write_policy")
        if write_policy is not None:
            _one_of(write_policy, WRITE_POLICIES, f"{where}.write_policy")
        if write_policy == "write-through" and index == 0:
            raise ConfigError(
                f"{where}.write_policy", "the first tier is where stores go; it has no tier above"
            )
        admit = m.get("admit", "always")
        _one_of(admit, ADMISSIONS, f"{where}.admit")
        if admit != "always" and index == 0:
            raise ConfigError(f"{where}.admit", "the first tier admits every store")
        options = {k: v for k, v in m.items() if k not in _TIER_COMMON_KEYS}
        tier_cls.validate_options(options, where)
        return cls(kind, name, policy, cap_bytes, cap_blocks, options, index, write_policy, admit)


@dataclass(frozen=True)
class CacheConfig:
    """The whole cache: block size in tokens, namespace, ordered tiers (fastest first)."""

    block_size: int = 16
    namespace: str = "default"
    tiers: tuple[TierConfig, ...] = ()
    promote: bool = True
    telemetry: TelemetryConfig | None = None  # off unless a [telemetry] table is given
    write_through_queue: int = 4096  # blocks waiting for write-through, per tier
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    loading: LoadingConfig = field(default_factory=LoadingConfig)

    @property
    def admit_on_reuse(self) -> list[bool]:
        """Per tier, whether it takes only blocks seen twice (`admit = "on-reuse"`)."""
        return [t.admit == "on-reuse" for t in self.tiers]

    @property
    def write_through(self) -> list[bool]:
        """Per tier, whether new blocks are also written into it as they are stored.

        A tier's `write_policy` decides; without one, a persistent tier right below a volatile
        one is written through (what the volatile tiers hold survives a crash or a stop that
        skips close), and every other tier is written back (demoted on eviction)."""
        from tiercache.tiers import tier_class

        persistent = [tier_class(t.kind).persistent for t in self.tiers]
        return [
            i > 0
            and not tier_class(t.kind).read_only  # written never (NVMe siblings)
            and (
                t.write_policy == "write-through"
                or (t.write_policy is None and persistent[i] and not persistent[i - 1])
            )
            for i, t in enumerate(self.tiers)
        ]

    def __post_init__(self) -> None:
        _expect(self.block_size, int, "block_size", "an int (tokens per block)")
        if self.block_size < 1:
            raise ConfigError("block_size", f"must be >= 1, got {self.block_size}")
        _expect(self.namespace, str, "namespace", "a string")
        if not self.namespace:
            raise ConfigError("namespace", "must not be empty")
        _expect(self.promote, bool, "promote", "true or false")
        _expect(self.deadlines, DeadlineConfig, "deadlines", "a DeadlineConfig")
        _expect(self.loading, LoadingConfig, "loading", "a LoadingConfig")
        _expect(self.write_through_queue, int, "write_through_queue", "an int (blocks)")
        if self.write_through_queue < 1:
            n = self.write_through_queue
            raise ConfigError("write_through_queue", f"must be >= 1, got {n}")
        if not self.tiers:
            raise ConfigError("tiers", "at least one tier is required")
        names = [t.name for t in self.tiers]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise ConfigError(
                    f"tiers[{i}].name",
                    f"duplicate tier name {n!r}; give each tier a distinct 'name'",
                )

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> CacheConfig:
        """Validate a mapping of the TOML schema (see README)."""
        if not isinstance(m, Mapping):
            raise ConfigError("config", f"expected a mapping, got {type(m).__name__}")
        unknown = sorted(set(m) - _TOP_KEYS)
        if unknown:
            raise ConfigError(unknown[0], f"unknown setting; known: {', '.join(sorted(_TOP_KEYS))}")
        tiers = m.get("tiers")
        if not isinstance(tiers, list | tuple) or not tiers:
            raise ConfigError("tiers", "expected a non-empty list of [[tiers]] tables")
        return cls(
            block_size=m.get("block_size", 16),
            namespace=m.get("namespace", "default"),
            promote=m.get("promote", True),
            write_through_queue=m.get("write_through_queue", 4096),
            tiers=tuple(TierConfig.from_mapping(t, i) for i, t in enumerate(tiers)),
            telemetry=(TelemetryConfig.from_mapping(m["telemetry"]) if "telemetry" in m else None),
            deadlines=DeadlineConfig.from_mapping(m.get("deadlines", {})),
            loading=LoadingConfig.from_mapping(m.get("loading", {})),
        )

    @classmethod
    def from_toml(cls, path: str | Path) -> CacheConfig:
        """Read and validate a TOML file."""
        return cls.from_mapping(read_toml(path))

    @classmethod
    def load(cls, source: CacheConfig | Mapping[str, Any] | str | Path) -> CacheConfig:
        """Accept a `CacheConfig`, a mapping, or a path to a TOML file."""
        if isinstance(source, CacheConfig):
            return source
        if isinstance(source, Mapping):
            return cls.from_mapping(source)
        if isinstance(source, str | Path):
            return cls.from_toml(source)
        raise ConfigError(
            "config",
            f"expected a CacheConfig, a mapping or a TOML path, got {type(source).__name__}",
        )


# The settings each table takes: its record's fields.
_TELEMETRY_KEYS, _DEADLINE_KEYS, _LOADING_KEYS, _TOP_KEYS = (
    {f.name for f in fields(c)}
    for c in (TelemetryConfig, DeadlineConfig, LoadingConfig, CacheConfig)
)
