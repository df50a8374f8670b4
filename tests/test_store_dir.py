"""tiers/store_dir.py on real files: private directories, disk reservation, store metadata,
over capacity at open."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from pathlib import Path

import pytest

from tests.unprivileged import as_unprivileged
from tiercache.errors import ConfigError
from tiercache.tiers import store_dir
from tiercache.tiers.store_dir import (
    DirRules,
    MetaFormat,
    over_capacity,
    prepare_dir,
    reserve,
    store_path,
    warn_over_capacity,
)

LMDB_LIKE = DirRules("LMDB", frozenset({"data.mdb", "lock.mdb"}))
NVME_LIKE = DirRules(
    "NVMe",
    frozenset({"meta.json", "slab", "index"}),
    marker="meta.json",
    skip=re.compile(r"instance[1-9][0-9]*"),
)
META = MetaFormat("test", "tiercache-test", 2)


def test_creates_a_private_directory(tmp_path) -> None:
    got = prepare_dir(tmp_path / "s", LMDB_LIKE)
    assert got == os.path.realpath(tmp_path / "s")
    assert os.stat(got).st_mode & 0o777 == 0o700
    assert prepare_dir(str(tmp_path / "s"), LMDB_LIKE) == got  # an existing one is fine


def test_path_must_be_a_path(tmp_path) -> None:
    for bad in (None, "", 3):
        with pytest.raises(ConfigError, match="expected a directory path"):
            store_path(bad)
    assert store_path("~") == os.path.expanduser("~")


def test_parent_must_exist(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"parent directory .* does not exist") as e:
        prepare_dir(tmp_path / "no" / "s", LMDB_LIKE)
    assert e.value.field == "path"


def test_a_file_is_not_a_directory(tmp_path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        prepare_dir(tmp_path / "f", LMDB_LIKE)
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        prepare_dir(tmp_path / "dangling", LMDB_LIKE)


def test_group_writable_is_refused(tmp_path) -> None:
    d = tmp_path / "s"
    d.mkdir()
    d.chmod(0o770)
    with pytest.raises(ConfigError, match=r"writable by group or others \(mode 770\)"):
        prepare_dir(d, LMDB_LIKE)


def test_unreadable_is_refused() -> None:
    def check(base: Path) -> None:  # as a user whose permission bits apply (not root)
        d = base / "s"
        d.mkdir(mode=0o300)
        try:
            with pytest.raises(ConfigError, match="not readable and writable"):
                prepare_dir(d, LMDB_LIKE)
        finally:
            d.chmod(0o700)

    as_unprivileged(check)


def test_other_owner_is_refused(tmp_path, monkeypatch) -> None:
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    monkeypatch.setattr(store_dir.os, "geteuid", lambda: 12345)
    with pytest.raises(ConfigError, match=r"owned by uid .*, not by this user"):
        prepare_dir(d, LMDB_LIKE)


def test_foreign_files_are_refused(tmp_path) -> None:
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    (d / "data.mdb").write_bytes(b"")
    prepare_dir(d, LMDB_LIKE)
    for n in ("a", "b", "c", "d"):
        (d / n).write_bytes(b"")
    with pytest.raises(
        ConfigError, match=r"not part of a tiercache LMDB store \(a, b, c, \.\.\.\)"
    ):
        prepare_dir(d, LMDB_LIKE)


def test_marker_and_skipped_names(tmp_path) -> None:
    d = tmp_path / "s"
    d.mkdir(mode=0o700)
    (d / "instance1").mkdir()
    (d / "slab").write_bytes(b"")
    prepare_dir(d, NVME_LIKE)  # our files and an instance directory
    (d / "other").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"tiercache NVMe store \(other\)"):
        prepare_dir(d, NVME_LIKE)
    (d / "meta.json").write_bytes(b"{}")
    prepare_dir(d, NVME_LIKE)  # the marker makes it ours, whatever else it holds
    assert NVME_LIKE.foreign({"x", "instance2", "slab"}) == ["x"]
    assert LMDB_LIKE.foreign({"instance2", "data.mdb"}) == ["instance2"]


def test_reserve_allocates(tmp_path) -> None:
    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert reserve(fd, 0, 1 << 20, no_room="none") is None
        assert os.fstat(fd).st_size == 1 << 20
        assert reserve(fd, 1 << 20, 4096, no_room="none") is None
        assert os.fstat(fd).st_size == (1 << 20) + 4096
    finally:
        os.close(fd)


def _failing(code: int):
    def fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    return fallocate


def test_reserve_errors(tmp_path, monkeypatch) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        monkeypatch.setattr(store_dir.os, "posix_fallocate", _failing(errno.ENOSPC))
        with pytest.raises(ConfigError, match="no room here") as e:
            reserve(fd, 0, 4096, no_room="no room here")
        assert e.value.field == "capacity"
        monkeypatch.setattr(store_dir.os, "posix_fallocate", _failing(errno.EOPNOTSUPP))
        refused = reserve(fd, 0, 4096, no_room="x")
        assert isinstance(refused, OSError) and refused.errno == errno.EOPNOTSUPP
        monkeypatch.setattr(store_dir.os, "posix_fallocate", _failing(errno.EIO))
        with pytest.raises(OSError) as e2:
            reserve(fd, 0, 4096, no_room="x")
        assert e2.value.errno == errno.EIO
    finally:
        os.close(fd)


def test_store_meta_roundtrip(tmp_path) -> None:
    f = tmp_path / "meta.json"
    meta = {"format": "tiercache-test", "version": 2, "block_bytes": 4096, "slots": 3}
    f.write_text(json.dumps(meta))
    fmt = MetaFormat("test", "tiercache-test", 2, positive=("block_bytes", "slots"))
    got = fmt.parse(f.read_bytes(), "m")
    assert got == meta


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x80\x04pickle", "m: unreadable tiercache metadata"),
        (b"{not json", "m: unreadable tiercache metadata"),
        (b"[1]", "m: unreadable tiercache metadata"),
        (b'{"format": "other", "version": 2}', "m does not describe a tiercache test store"),
        (
            b'{"format": "tiercache-test", "version": 1, "block_bytes": 1}',
            "m holds a tiercache test store of format version 1; this build reads version 2",
        ),
        (
            b'{"format": "tiercache-test", "version": 2, "block_bytes": true}',
            "m: bad block_bytes True in tiercache metadata",
        ),
        (
            b'{"format": "tiercache-test", "version": 2, "block_bytes": 0}',
            "m: bad block_bytes 0 in tiercache metadata",
        ),
    ],
)
def test_store_meta_refused(tmp_path, raw: bytes, message: str) -> None:
    f = tmp_path / "meta.json"
    f.write_bytes(raw)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        META.parse(f.read_bytes(), "m")
    assert e.value.field == "path"


def test_check_store_meta_takes_decoded() -> None:
    meta = {"format": "tiercache-test", "version": 2, "block_bytes": 1}
    assert META.check(meta, "m") is meta
    with pytest.raises(ConfigError, match="unreadable"):
        META.check(None, "m")


def test_over_capacity(caplog) -> None:
    assert over_capacity(5, 8) == 0
    assert over_capacity(8, 8) == 0
    assert over_capacity(11, 8) == 3
    log = logging.getLogger("tiercache.test_store_dir")
    with caplog.at_level(logging.WARNING, logger=log.name):
        warn_over_capacity(log, "/s", 8, 8, 0, "the %d oldest go")
        assert not caplog.records
        warn_over_capacity(log, "/s", 11, 8, 3, "the %d oldest go")
    (rec,) = caplog.records
    assert rec.name == log.name
    assert (
        rec.getMessage() == "/s: holds 11 blocks of this namespace, capacity is 8: the 3 oldest go"
    )


def test_block_bytes_mismatch_names_the_field_and_the_way_out() -> None:
    """One rule for every store: the block size recorded must be the tier's."""
    nvme = MetaFormat("NVMe", "f", 1)
    nvme.check_block_bytes(4096, 4096, "the store at 'x'")  # equal: nothing raised
    with pytest.raises(
        ConfigError,
        match=r"holds blocks of 4096 bytes; .*block_bytes=8192 "
        r"\(use the same block size or another path\)",
    ) as exc:
        nvme.check_block_bytes(4096, 8192, "the store at 'x'")
    assert exc.value.field == "block_bytes"
    redis = MetaFormat("Redis", "f", 1, other="prefix")
    with pytest.raises(ConfigError, match="or another prefix"):
        redis.check_block_bytes(None, 8192, "the store under b'p'")
