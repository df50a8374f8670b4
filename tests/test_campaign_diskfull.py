"""Disk-full and I/O-error campaign: the persistent tiers on a real, small tmpfs (mounted here
when running as root; skipped otherwise) and under seeded injected ENOSPC/EIO. Stores fail
cleanly (the block is a miss, never half-served), loads of other blocks keep working,
capacity accounting stays right (no slot leaks: used == ready <= capacity after every call),
the cache recovers once space returns, and a reopen serves only exact bytes.

Bounded here (TIERCACHE_DISKFULL_OPS, default 300 cache calls per tier under injected
faults); `-m stress`: 3,000.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
import torch

from tests.campaign_support import ChildDied, blocks, key, report, run_child, scale
from tiercache import TierCache
from tiercache.errors import ConfigError
from tiercache.tiers import lmdb as lmdb_tier

BB = 64 * 1024


@contextlib.contextmanager
def small_fs(path: Path, size: str) -> Iterator[Path]:
    """A fresh tmpfs of `size` mounted at `path` (root only), unmounted afterwards."""
    path.mkdir(mode=0o700)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); injected faults only")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(fs: Path) -> Path:
    """Another tenant takes every byte left on the filesystem."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 16, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, bytes(size)):
                    pass
    finally:
        os.close(fd)
    return filler


def check_accounting(cache: TierCache, *, quiet: bool = False) -> None:
    """Capacity holds; with `quiet` (nothing in flight: no write-through copy either) every
    used slot holds a ready block, i.e. no slot leaked."""
    for medium, s in cache.stats().items():
        assert s["ready_blocks"] <= s["used_blocks"] <= s["capacity_blocks"], (medium, s)
        if quiet:
            assert s["used_blocks"] == s["ready_blocks"], (medium, s)


def cfg(kind: str, path: Path, blocks_: int, **opts) -> dict:
    return {
        "namespace": "diskfull",
        "tiers": [{"kind": kind, "blocks": blocks_, "path": str(path), **opts}],
    }


# -- a real full filesystem --------------------------------------------------------------------
def test_nvme_on_a_full_tmpfs(tmp_path) -> None:
    with small_fs(tmp_path / "fs", "4m") as fs:
        # No room for the slab: refused at open, naming the capacity.
        with pytest.raises(ConfigError, match=r"tiers\[0\]\.capacity: .*no room"):
            TierCache.open(cfg("nvme", fs / "big", 200, direct=False), block_bytes=BB)
        cache = TierCache.open(cfg("nvme", fs / "nvme", 24, direct=False), block_bytes=BB)
        filler = fill(fs)
        held: set[int] = set()
        failed = 0
        try:
            # The slab is reserved: data writes fit; journal appends hit ENOSPC at each new
            # page. A failed store is a miss; everything stored before still loads.
            for i in range(400):
                n = cache.put([key(i)], blocks([i], BB))
                check_accounting(cache, quiet=True)
                if n:
                    held.add(i)
                else:
                    failed += 1
                for j in random.Random(i).sample(sorted(held), min(3, len(held))):
                    got = cache.get([key(j)])
                    assert len(got) == 0 or torch.equal(got, blocks([j], BB))
                held = {j for j in held if cache.lookup([key(j)])}
            assert failed > 0, "the full filesystem never failed a store"
            assert cache.stats()["nvme"]["errors"] >= failed
            # Space comes back: stores succeed again.
            filler.unlink()
            assert cache.put([key(1000)], blocks([1000], BB)) == 1
            check_accounting(cache, quiet=True)
            held = {j for j in held if cache.lookup([key(j)])} | {1000}
        finally:
            cache.close()
        with TierCache.open(cfg("nvme", fs / "nvme", 24, direct=False), block_bytes=BB) as c2:
            for j in held:
                assert torch.equal(c2.get([key(j)]), blocks([j], BB)), j
    report("diskfull", setup="tmpfs 4 MiB, nvme", stores=401, stores_failed=failed, blocks_lost=0)


def lmdb_on_full_fs(fs: str) -> dict:
    """In a child process (a SIGBUS must not take the test runner with it)."""
    fsp = Path(fs)
    out: dict = {}
    try:
        TierCache.open(cfg("lmdb", fsp / "big", 400, compression="none"), block_bytes=BB)
    except ConfigError as exc:
        out["refused"] = str(exc)
    cache = TierCache.open(cfg("lmdb", fsp / "lmdb", 16, compression="none"), block_bytes=BB)
    filler = fill(fsp)
    ok = wrong = 0
    try:
        # The map's blocks are reserved: churning 5x the capacity on a full disk works.
        for i in range(80):
            ok += cache.put([key(i)], blocks([i], BB))
            check_accounting(cache, quiet=True)
            got = cache.get([key(i)])
            wrong += int(len(got) == 1 and not torch.equal(got, blocks([i], BB)))
    finally:
        cache.close()
        filler.unlink()
    out.update(stored=ok, wrong=wrong)
    return out


def test_lmdb_on_a_full_tmpfs_never_crashes(tmp_path) -> None:
    # Regression: with writemap over a sparse data file, the first write into a hole on a full
    # disk killed the process with SIGBUS. The map is now reserved at open.
    with small_fs(tmp_path / "fs", "32m") as fs:
        try:
            got = run_child(lmdb_on_full_fs, str(fs))
        except ChildDied as exc:
            raise AssertionError(f"the LMDB tier crashed on a full disk: {exc}") from None
    assert "tiers[0].capacity" in got["refused"] and "no room" in got["refused"]
    assert got["stored"] == 80 and got["wrong"] == 0
    report("diskfull", setup="tmpfs 32 MiB, lmdb", stores=80, stores_failed=0, blocks_lost=0)


# -- injected faults ---------------------------------------------------------------------------
class Faults:
    """Seeded failures of the tiers' I/O calls while `on`."""

    def __init__(self, seed: int, rate: float) -> None:
        self.rnd = random.Random(seed)
        self.rate = rate
        self.on = True
        self.injected = 0

    def maybe(self, what: str) -> None:
        if self.on and self.rnd.random() < self.rate:
            self.injected += 1
            code = self.rnd.choice([errno.ENOSPC, errno.EIO])
            raise OSError(code, f"injected {os.strerror(code)} in {what}")


def install_nvme_faults(monkeypatch, faults: Faults) -> None:
    real_pwrite, real_preadv, real_sync = os.pwrite, os.preadv, os.fdatasync

    def pwrite(fd, data, off):
        faults.maybe("pwrite")
        return real_pwrite(fd, data, off)

    def preadv(fd, bufs, off):
        faults.maybe("preadv")
        return real_preadv(fd, bufs, off)

    def fdatasync(fd):
        faults.maybe("fdatasync")
        return real_sync(fd)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "fdatasync", fdatasync)


def install_lmdb_faults(monkeypatch, faults: Faults) -> None:
    real_txn, real_begin = lmdb_tier.LMDBTier._txn, lmdb_tier.LMDBTier._begin

    def txn(self, chunk, encoded):
        try:
            faults.maybe("write txn")
        except OSError as exc:
            err = lmdb.MapFullError if exc.errno == errno.ENOSPC else lmdb.DiskError
            raise err(str(exc)) from None
        return real_txn(self, chunk, encoded)

    def begin(self, write):
        if not write:
            faults.maybe("read txn")
        return real_begin(self, write)

    monkeypatch.setattr(lmdb_tier.LMDBTier, "_txn", txn)
    monkeypatch.setattr(lmdb_tier.LMDBTier, "_begin", begin)


def fault_campaign(kind: str, tmp_path: Path, monkeypatch, ops: int, seed: int) -> dict:
    """A CPU tier over a persistent one; seeded puts and gets of 4-block chains while 15% of
    the persistent tier's I/O calls fail."""
    path = tmp_path / kind
    opts = {"fsync": "always"} if kind == "nvme" else {"compression": "zstd", "sync": "batch"}
    config = {
        "namespace": "faults",
        "tiers": [
            {"kind": "cpu", "blocks": 8},
            {"kind": kind, "blocks": 32, "path": str(path), **opts},
        ],
    }
    bb = 16 * 1024
    faults = Faults(seed, 0.15)
    faults.on = False  # on once the cache is open: this campaign is about serving
    (install_nvme_faults if kind == "nvme" else install_lmdb_faults)(monkeypatch, faults)
    rnd = random.Random(seed)
    chains = [[100 * c + j for j in range(4)] for c in range(24)]
    puts = gets = hits = 0
    cache = TierCache.open(config, block_bytes=bb)
    faults.on = True
    try:
        for _ in range(ops):
            chain = rnd.choice(chains)
            ks = [key(i) for i in chain]
            if rnd.random() < 0.5:
                cache.put(ks, blocks(chain, bb))
                puts += 1
            else:
                got = cache.get(ks)
                gets += 1
                hits += len(got)
                # A prefix, exact: never a block another key wrote, never a torn one.
                assert torch.equal(got, blocks(chain[: len(got)], bb))
            check_accounting(cache)
        errors = cache.stats()[kind]["errors"]
        assert faults.injected > 0 and errors > 0
        faults.on = False
        # Faults gone: every chain stores and loads whole.
        cache.flush()  # the copies queued under faults land or fail: nothing in flight
        check_accounting(cache, quiet=True)
        for chain in chains[:4]:
            ks = [key(i) for i in chain]
            assert cache.put(ks, blocks(chain, bb)) == 4
            assert torch.equal(cache.get(ks), blocks(chain, bb))
        cache.flush()
        check_accounting(cache, quiet=True)
    finally:
        faults.on = False
        cache.close()
    # Reopened: whatever the persistent tier serves is exact.
    served = 0
    with TierCache.open(config, block_bytes=bb) as cache:
        for chain in chains:
            got = cache.get([key(i) for i in chain])
            assert torch.equal(got, blocks(chain[: len(got)], bb))
            served += len(got)
    return report(
        "diskfull",
        setup=f"injected ENOSPC/EIO, cpu + {kind}",
        ops=ops,
        puts=puts,
        gets=gets,
        block_hits=hits,
        faults_injected=faults.injected,
        errors_counted=errors,
        served_after_reopen=served,
        wrong=0,
        blocks_lost=0,
    )


@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_injected_faults(kind: str, tmp_path, monkeypatch) -> None:
    fault_campaign(kind, tmp_path, monkeypatch, scale("diskfull_ops", 300), seed=3)


@pytest.mark.stress
@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_injected_faults_long(kind: str, tmp_path, monkeypatch) -> None:
    fault_campaign(kind, tmp_path, monkeypatch, scale("diskfull_ops", 3000), seed=2026)
