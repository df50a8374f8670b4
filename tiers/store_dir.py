"""The rules every on-disk store directory follows (NVMe, LMDB), in one place:

- `prepare_dir`: the store directory is private: created 0700 when missing, else an existing
  directory of this user, not writable by group or others, holding no other program's files
  (`DirRules` names which files are the store's).
- `reserve`: disk blocks are allocated at open (posix_fallocate), so a full disk shows there,
  as a ConfigError naming the capacity, not halfway through a store.
- `MetaFormat.parse` / `.check`: a store's metadata is JSON naming its format and version
  (and positive sizes); anything else is refused with a message naming the problem.
- `over_capacity` / `warn_over_capacity`: a store that holds more blocks of a namespace than
  the tier's capacity at open is no error: the excess is counted and reported by one warning
  (what happens to those blocks is the store's: `then`).

Pure functions over explicit inputs (paths, file descriptors, counts); no tier imports."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from tiercache.errors import ConfigError

# errnos of a filesystem that cannot preallocate (tmpfs on old kernels, some FUSE, NFSv3)
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)


@dataclass(frozen=True)
class DirRules:
    """Which entries of a store directory are the store's.

    `kind` names the store in messages ("LMDB", "NVMe"); `ours`: the file names the store
    writes; `marker`: a file whose presence makes the directory the store's whatever else it
    holds (None: no such file); `skip`: names matching it (e.g. instance directories) are
    never counted as foreign."""

    kind: str
    ours: frozenset[str]
    marker: str | None = None
    skip: re.Pattern[str] | None = None

    def foreign(self, names: set[str] | frozenset[str]) -> list[str]:
        """The entries of `names` that belong to another program, sorted (empty: none)."""
        mine = {n for n in names if self.skip is None or not self.skip.fullmatch(n)}
        if self.marker is not None and self.marker in mine:
            return []
        return sorted(mine - self.ours)


def store_path(path: object) -> str:
    """`path` (a str or os.PathLike naming a directory) made absolute, `~` expanded;
    ConfigError("path") for anything else."""
    if not isinstance(path, str | os.PathLike) or not os.fspath(path):
        raise ConfigError("path", f"expected a directory path, got {path!r}")
    return os.path.abspath(os.path.expanduser(os.fspath(path)))


def prepare_dir(path: object, rules: DirRules) -> str:
    """Check (or create, 0700) a private store directory; its real path, or ConfigError("path")
    naming the problem. A concurrent opener creating it at the same moment is fine."""
    p = store_path(path)
    if not os.path.lexists(p):
        parent = os.path.dirname(p)
        if not os.path.isdir(parent):
            raise ConfigError("path", f"{p}: parent directory {parent} does not exist")
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass  # a concurrent opener made it; checked below like any existing directory
        except OSError as exc:  # e.g. EACCES, EROFS
            raise ConfigError("path", f"{p}: cannot create it: {exc.strerror}") from None
    if not os.path.isdir(p):
        raise ConfigError("path", f"{p} exists and is not a directory")
    real = os.path.realpath(p)
    st = os.stat(real)
    if st.st_uid != os.geteuid():
        raise ConfigError(
            "path", f"{p} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})"
        )
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        raise ConfigError(
            "path",
            f"{p} is writable by group or others (mode {mode:o}); use a private directory "
            "(chmod 700)",
        )
    if not os.access(real, os.R_OK | os.W_OK | os.X_OK):
        raise ConfigError("path", f"{p} is not readable and writable by this user")
    foreign = rules.foreign(set(os.listdir(real)))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ConfigError(
            "path",
            f"{p} holds files of another program, not part of a tiercache {rules.kind} store "
            f"({shown}); use an empty or new directory",
        )
    return real


def reserve(fd: int, offset: int, length: int, *, no_room: str) -> OSError | None:
    """Allocate the disk blocks of `fd` from `offset` for `length` bytes, now: a full disk
    shows here as ConfigError("capacity", `no_room`), not mid-write. The filesystem's refusal
    when it cannot preallocate (the caller falls back), None when reserved; others raise."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ConfigError("capacity", no_room) from None
        if exc.errno not in _NO_FALLOCATE:
            raise
        return exc
    return None


@dataclass(frozen=True)
class MetaFormat:
    """What a store's metadata must say: `store_format` at `version`, with a positive int
    for each field of `positive`; `kind` names the store in messages ("LMDB", "NVMe")."""

    kind: str
    store_format: str
    version: int
    positive: tuple[str, ...] = ("block_bytes",)
    # The config field a mismatch is charged to, and what the user can do about it: a store
    # on disk is a directory (`path`); a Redis store is a key prefix (`prefix`).
    field: str = "path"
    advice: str = "use another directory or remove it"
    other: str = "path"  # what else a tier opened with another block size can use
    older: tuple[int, ...] = ()  # earlier versions this build still opens (and upgrades)

    def check_block_bytes(self, stored: object, wanted: int, where: str) -> None:
        """ConfigError("block_bytes") unless the store (`where`) holds blocks of `wanted`
        bytes, the block size this tier was opened with."""
        if stored != wanted:
            raise ConfigError(
                "block_bytes",
                f"{where} holds blocks of {stored!r} bytes; this tier was opened with "
                f"block_bytes={wanted} (use the same block size or another {self.other})",
            )

    def check(self, meta: object, where: str) -> dict[str, Any]:
        """`meta` (a store's decoded metadata) as a dict when it is this format; else
        ConfigError(`field`) naming the problem, `where` naming the metadata."""
        if not isinstance(meta, dict):
            raise ConfigError(self.field, f"{where}: unreadable tiercache metadata")
        if meta.get("format") != self.store_format:
            raise ConfigError(
                self.field,
                f"{where} does not describe a tiercache {self.kind} store ({self.advice})",
            )
        if meta.get("version") != self.version and meta.get("version") not in self.older:
            raise ConfigError(
                self.field,
                f"{where} holds a tiercache {self.kind} store of format version "
                f"{meta.get('version')!r}; this build reads version {self.version} "
                f"({self.advice})",
            )
        for k in self.positive:
            v = meta.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(self.field, f"{where}: bad {k} {v!r} in tiercache metadata")
        return meta

    def parse(self, raw: bytes | memoryview, where: str) -> dict[str, Any]:
        """`raw` (JSON, never pickle) decoded and `check`ed; ConfigError ("... unreadable
        tiercache metadata") when it is not JSON."""
        try:
            meta = json.loads(bytes(raw).decode())
        except (UnicodeDecodeError, ValueError):
            meta = None
        return self.check(meta, where)


def over_capacity(held: int, capacity: int) -> int:
    """How many of the `held` blocks a namespace has in a store lie beyond a tier's
    `capacity` (0 when they fit)."""
    return max(0, held - capacity)


def warn_over_capacity(
    log: logging.Logger, path: str, held: int, capacity: int, excess: int, then: str
) -> None:
    """The one warning of a store over capacity at open, on the caller's `log` (none when
    `excess` is 0): `then` says what becomes of the excess, with one `%d` for its count."""
    if excess:
        log.warning(
            "%s: holds %d blocks of this namespace, capacity is %d: " + then,
            path,
            held,
            capacity,
            excess,
        )
