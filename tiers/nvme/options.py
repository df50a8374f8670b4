"""The NVMe tier's options and arguments, checked once with errors that name the field:
fsync mode, io_threads, instances (`instances`, `instance`, `instance_env`), keys."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tiercache.errors import ConfigError
from tiercache.tiers.base import KEY_BYTES

FSYNC_MODES = ("never", "batch", "always")
MAX_INSTANCES = 256  # `instances` and `instance` bound: directories tried at open
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_options(options: Mapping[str, Any], where: str) -> None:
    """The nvme-specific checks of a tier config's `options` (at `where`)."""
    if not options.get("path"):
        raise ConfigError(f"{where}.path", "an 'nvme' tier needs a directory path")
    if "fsync" in options:
        check_fsync(options["fsync"], f"{where}.fsync")
    if "io_threads" in options:
        check_io_threads(options["io_threads"], f"{where}.io_threads")
    check_instances(options.get("instances", 1), options.get("instance"), where)
    if "instance_env" in options:
        if "instance" in options:
            raise ConfigError(
                f"{where}.instance_env", "give 'instance' or 'instance_env', not both"
            )
        instance_from_env(options["instance_env"], where)


def check_keys(keys: Sequence[bytes] | None, n: int) -> Sequence[bytes]:
    if keys is None:
        raise ValueError(
            "keys: the nvme tier stores each block's key in its header; pass "
            "one 16-byte key per slot"
        )
    if len(keys) != n:
        raise ValueError(f"keys: expected {n} keys (one per slot), got {len(keys)}")
    for i, k in enumerate(keys):
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise ValueError(f"keys[{i}]: expected a {KEY_BYTES}-byte bytes key")
    return keys


def check_fsync(value: object, field: str) -> None:
    if value not in FSYNC_MODES:
        raise ConfigError(
            field, f"expected one of {', '.join(map(repr, FSYNC_MODES))}, got {value!r}"
        )


def check_io_threads(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise ConfigError(field, f"expected an int in 1..64, got {value!r}")


def check_instances(instances: object, instance: object, where: str = "") -> None:
    """`instances` in 1..MAX_INSTANCES, `instance` None or in 0..MAX_INSTANCES-1; ConfigError
    naming the field. (With `instance` given, `instances` is not used.)"""
    p = f"{where}." if where else ""

    def bad(v: object, top: int) -> bool:
        return isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < top

    if bad(instances, MAX_INSTANCES + 1) or instances == 0:
        raise ConfigError(
            f"{p}instances",
            f"expected how many processes may share this path at once, an int in "
            f"1..{MAX_INSTANCES}, got {instances!r}",
        )
    if instance is not None and bad(instance, MAX_INSTANCES):
        raise ConfigError(
            f"{p}instance", f"expected an int in 0..{MAX_INSTANCES - 1}, got {instance!r}"
        )


def instance_from_env(name: object, where: str = "") -> int | None:
    """The instance number in environment variable `name` (e.g. "LOCAL_RANK"), or None when
    `name` is None or the variable is unset; ConfigError naming `instance_env` if bad."""
    if name is None:
        return None
    field = f"{where}.instance_env" if where else "instance_env"
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise ConfigError(field, f"expected an environment variable name, got {name!r}")
    raw = os.environ.get(name)
    if raw is None:
        return None
    digits = raw.strip()
    k = int(digits) if digits.isascii() and digits.isdigit() else -1
    if not 0 <= k < MAX_INSTANCES:
        raise ConfigError(
            field, f"${name} is {raw!r}, not an instance number in 0..{MAX_INSTANCES - 1}"
        )
    return k
