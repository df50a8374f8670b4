"""Where an NVMe store lives: its file names, its instance directories (`path`,
`path/instance{k}`), the private-directory rules, and `meta.json` (format, version, slot
layout), read by the tier's open and by offline tools alike."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from dataclasses import replace
from typing import Any

from tiercache.errors import ConfigError
from tiercache.tiers.format import HEADER_SIZE
from tiercache.tiers.store_dir import DirRules, MetaFormat, prepare_dir

META, SLAB, INDEX, IMAGE = "meta.json", "slab", "index", "index.img"
_OURS = {META, META + ".tmp", SLAB, INDEX, INDEX + ".tmp", IMAGE, IMAGE + ".tmp"}
_STORE_FORMAT, _STORE_VERSION = "tiercache-nvme", 1
_META_FORMAT = MetaFormat("NVMe", _STORE_FORMAT, _STORE_VERSION, positive=())
# what the offline reader needs of a store's meta.json besides its format
_SHAPE_FORMAT = replace(_META_FORMAT, positive=("block_bytes", "capacity_blocks", "slot_bytes"))
_INSTANCE_DIR = re.compile(r"instance[1-9][0-9]*")
# a store directory holds our files and instance directories, or anything beside a meta.json
_DIR_RULES = DirRules("NVMe", frozenset(_OURS), marker=META, skip=_INSTANCE_DIR)


def instance_path(path: str, k: int) -> str:
    """The directory of instance `k` of an NVMe store configured at `path`: `path` itself
    for 0, ``path/instance{k}`` above."""
    return path if k == 0 else os.path.join(path, f"instance{k}")


def take_instance(base: str, instance: int | None, instances: int) -> tuple[str, int, int]:
    """Lock a store directory: `instance` when given, else the first free of `instances`
    under `base`. (directory, its fd holding the lock, k); ConfigError when none is free."""
    wanted = [instance] if instance is not None else range(instances)
    for k in wanted:
        path = instance_path(base, k)
        if k:
            prepare_dir(base, _DIR_RULES)  # it holds the instance directories
        prepare_dir(path, _DIR_RULES)  # created 0700, or checked: ours and private
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return path, fd, k
    held = "(another process or an unclosed tier)"
    if instance is None and instances > 1:
        raise ConfigError(
            "path",
            f"{base!r}: all {instances} instances are in use by other NVMe "
            f"tiers {held}; raise 'instances' or stop one",
        )
    where = instance_path(base, wanted[0])
    which = f" (instance {instance})" if instance else ""
    raise ConfigError("path", f"{where!r}{which} is in use by another NVMe tier {held}")


def instance_dirs(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """(k, directory) of the instances k >= 1 present under an NVMe store path, by k."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    found = [
        (int(n[8:]), os.path.join(os.fspath(path), n)) for n in names if _INSTANCE_DIR.fullmatch(n)
    ]
    return sorted(f for f in found if os.path.isdir(f[1]))


def open_nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


def read_meta_file(path: str) -> dict[str, Any] | None:
    """The store's `meta.json` (None if absent), checked for format and version; ConfigError
    naming the problem otherwise. Shared by the tier's open and the offline reader."""
    p = os.path.join(path, META)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # e.g. ELOOP: a symlink planted where our metadata belongs
        raise ConfigError("path", f"{p!r} cannot be opened ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(1 << 16)
    except OSError as exc:
        raise ConfigError("path", f"{p!r} is unreadable ({exc})") from None
    return _META_FORMAT.parse(raw, repr(p))


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The `meta.json` of an existing NVMe store, read without writing anything; ConfigError
    naming the problem when `path` is not one this build reads."""
    root = os.path.abspath(os.fspath(path))
    meta = read_meta_file(root)
    if meta is None:
        raise ConfigError("path", f"{root} is not an NVMe store (no {META})")
    p = os.path.join(root, META)
    _SHAPE_FORMAT.check(meta, repr(p))
    if (
        meta.get("header_bytes") != HEADER_SIZE
        or meta["slot_bytes"] < HEADER_SIZE + meta["block_bytes"]
    ):
        raise ConfigError("path", f"{p!r}: slot layout differs from this build's")
    return meta


def open_file(path: str, name: str, flags: int) -> int:
    """Open (creating it 0600) the store file `name` in directory `path`: never through a
    symlink, only a regular file of this user; ConfigError naming the problem."""
    p = os.path.join(path, name)
    try:
        fd = os.open(p, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError("path", f"{p!r} is a symlink; refusing to follow it") from None
        raise
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
    if problem:
        os.close(fd)
        raise ConfigError("path", f"{p!r} {problem}")
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)
    return fd


def store_meta(block_bytes: int, capacity_blocks: int, slot_bytes: int) -> dict[str, Any]:
    """The content of `meta.json` for a store of this shape."""
    return {
        "format": _STORE_FORMAT,
        "version": _STORE_VERSION,
        "block_bytes": block_bytes,
        "capacity_blocks": capacity_blocks,
        "slot_bytes": slot_bytes,
        "header_bytes": HEADER_SIZE,
    }


def load_meta(path: str, block_bytes: int, slot_bytes: int) -> dict[str, Any] | None:
    """The store's `meta.json` at `path` (None: there is none yet); ConfigError unless it
    holds blocks of `block_bytes` in slots of `slot_bytes` with this build's header."""
    meta = read_meta_file(path)
    if meta is None:
        return None
    _META_FORMAT.check_block_bytes(meta.get("block_bytes"), block_bytes, f"the store at {path!r}")
    if meta.get("slot_bytes") != slot_bytes or meta.get("header_bytes") != HEADER_SIZE:
        raise ConfigError(
            "path",
            f"{os.path.join(path, META)!r}: slot layout {meta.get('slot_bytes')!r} bytes "
            f"differs from this build's {slot_bytes}",
        )
    return meta
