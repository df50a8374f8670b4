"""NVMe tier: adjacent slots of one read or write go to the disk as one syscall per run
(`io.slot_runs`, `tier.RUN_BYTES`), on real files, O_DIRECT and buffered. Each slot is still
verified and reported alone: a corrupt, short or unreadable slot inside a run fails only its
own position, and its row is never written."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from tests.tier_conformance import keys_for, rand_blocks
from tiercache.tiers import format as fmt
from tiercache.tiers.nvme import NVMeTier
from tiercache.tiers.nvme import tier as nvme_tier
from tiercache.tiers.nvme.io import SlotRun, slot_runs

BB = 3000  # a slot of 4096 bytes: header + payload + padding
SENTINEL = 0xA5


# -- slot_runs ------------------------------------------------------------------------------
def test_runs_group_adjacent_slots_by_slot() -> None:
    assert slot_runs([4, 5, 6, 9, 10, 2], 8) == [
        SlotRun(2, 1, ((0, 5),)),
        SlotRun(4, 3, ((0, 0), (1, 1), (2, 2))),
        SlotRun(9, 2, ((0, 3), (1, 4))),
    ]


def test_runs_take_slots_in_any_order() -> None:
    assert slot_runs([7, 5, 6], 8) == [SlotRun(5, 3, ((0, 1), (1, 2), (2, 0)))]


def test_runs_are_capped() -> None:
    runs = slot_runs(list(range(10, 17)), 3)
    assert [(r.first, r.count) for r in runs] == [(10, 3), (13, 3), (16, 1)]
    assert [i for r in runs for _, i in r.members] == list(range(7))
    assert [(r.first, r.count) for r in slot_runs([1, 2, 3], 1)] == [(1, 1), (2, 1), (3, 1)]


def test_a_slot_named_twice_is_read_once() -> None:
    assert slot_runs([3, 4, 3], 8) == [SlotRun(3, 2, ((0, 0), (0, 2), (1, 1)))]


def test_runs_of_nothing_and_bad_caps() -> None:
    assert slot_runs([], 4) == []
    with pytest.raises(ValueError, match="max_slots"):
        slot_runs([1], 0)


# -- the tier on real files -----------------------------------------------------------------
@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct(request) -> bool:
    return request.param


def open_tier(path: Path, direct: bool, capacity: int = 16) -> NVMeTier:
    t = NVMeTier(
        path=str(path), block_bytes=BB, capacity_blocks=capacity, namespace="runs", direct=direct
    )
    assert t.direct == direct  # ext4 here takes O_DIRECT
    return t


def record_io(monkeypatch, t: NVMeTier) -> list[tuple[str, int, int]]:
    """Record (call, offset, bytes) of every slab pwrite / preadv of `t`."""
    calls: list[tuple[str, int, int]] = []
    real_w, real_r = os.pwrite, os.preadv

    def pwrite(fd, buf, off):
        if fd == t._fd:
            calls.append(("pwrite", off, len(buf)))
        return real_w(fd, buf, off)

    def preadv(fd, bufs, off):
        if fd == t._fd:
            calls.append(("preadv", off, sum(len(b) for b in bufs)))
        return real_r(fd, bufs, off)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "preadv", preadv)
    return calls


def stored(t: NVMeTier, slots: list[int], seed: int = 1) -> tuple[list[bytes], torch.Tensor]:
    keys = keys_for(len(slots), 100 * seed)
    data = rand_blocks(len(slots), BB, seed)
    t.write(slots, data, keys)
    return keys, data


@pytest.fixture(params=["read", "read_to"])
def how(request) -> str:
    """Through `read` (into a tensor) or `read_to` (rows handed over from the run buffers)."""
    return request.param


def read(
    t: NVMeTier, slots: list[int], keys: list[bytes], how: str = "read"
) -> tuple[torch.Tensor, list[int]]:
    out = torch.full((len(slots), BB), SENTINEL, dtype=torch.uint8)
    if how == "read":
        return out, t.read(slots, out, keys)
    seen: list[int] = []

    def sink(positions: list[int], rows: torch.Tensor) -> None:
        seen.extend(positions)
        out[positions] = rows

    bad = t.read_to(slots, sink, keys)
    assert sorted(seen + bad) == list(range(len(slots)))  # each position once: good or bad
    return out, bad


def untouched(row: torch.Tensor) -> bool:
    return bool((row == SENTINEL).all())


def test_one_syscall_per_run_of_adjacent_slots(tmp_path, monkeypatch, direct) -> None:
    t = open_tier(tmp_path / "nvme", direct)
    sb = t.slot_bytes
    try:
        slots = [3, 4, 5, 6, 9, 11, 12]
        calls = record_io(monkeypatch, t)
        keys, data = stored(t, slots)
        runs = [(3 * sb, 4 * sb), (9 * sb, sb), (11 * sb, 2 * sb)]
        assert sorted(c[1:] for c in calls) == runs and {c[0] for c in calls} == {"pwrite"}
        calls.clear()
        order = [6, 2, 0, 5, 1, 3, 4]  # positions in any order read the same runs
        out, bad = read(t, [slots[i] for i in order], [keys[i] for i in order])
        assert bad == [] and torch.equal(out, data[order])
        assert sorted(c[1:] for c in calls) == runs and {c[0] for c in calls} == {"preadv"}
    finally:
        monkeypatch.undo()
        t.close()


def test_runs_are_capped_at_run_bytes(tmp_path, monkeypatch, direct) -> None:
    monkeypatch.setattr(nvme_tier, "RUN_BYTES", 3 * 4096 + 100)  # read at open: 3 slots
    t = open_tier(tmp_path / "nvme", direct)
    sb = t.slot_bytes
    try:
        slots = list(range(8))
        calls = record_io(monkeypatch, t)
        keys, data = stored(t, slots)
        out, bad = read(t, slots, keys)
        assert bad == [] and torch.equal(out, data)
        runs = [(0, 3 * sb), (3 * sb, 3 * sb), (6 * sb, 2 * sb)]
        assert [c[1:] for c in calls if c[0] == "pwrite"] == runs
        assert [c[1:] for c in calls if c[0] == "preadv"] == runs
    finally:
        monkeypatch.undo()
        t.close()


def test_a_slot_read_twice_in_one_call(tmp_path, direct, how) -> None:
    t = open_tier(tmp_path / "nvme", direct)
    try:
        keys, data = stored(t, [0, 1])
        out, bad = read(t, [1, 0, 1], [keys[1], keys[0], keys[1]], how)
        assert bad == [] and torch.equal(out, data[[1, 0, 1]])
    finally:
        t.close()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_corrupt_slot_inside_a_run_fails_only_its_block(tmp_path, direct, where, how) -> None:
    t = open_tier(tmp_path / "nvme", direct)
    sb = t.slot_bytes
    try:
        slots = list(range(2, 8))
        keys, data = stored(t, slots)
        off = 4 * sb + (fmt.HEADER_SIZE + 100 if where == "payload" else 20)  # slot 4: pos 2
        with open(tmp_path / "nvme" / "slab", "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
        out, bad = read(t, slots, keys, how)
        assert bad == [2] and untouched(out[2])  # nothing unverified is handed back
        good = [0, 1, 3, 4, 5]
        assert torch.equal(out[good], data[good])
    finally:
        t.close()


def test_a_short_read_at_the_slab_end_fails_only_the_cut_slot(tmp_path, direct, how) -> None:
    t = open_tier(tmp_path / "nvme", direct, capacity=8)
    sb = t.slot_bytes
    try:
        slots = [5, 6, 7]  # the last three slots of the slab
        keys, data = stored(t, slots)
        os.truncate(tmp_path / "nvme" / "slab", 7 * sb + fmt.HEADER_SIZE + 10)  # cut slot 7
        out, bad = read(t, slots, keys, how)
        assert bad == [2] and untouched(out[2])
        assert torch.equal(out[:2], data[:2])
    finally:
        t.close()


def test_an_io_error_inside_a_run_fails_only_its_slot(tmp_path, monkeypatch, direct, how) -> None:
    t = open_tier(tmp_path / "nvme", direct)
    sb = t.slot_bytes
    try:
        slots = list(range(6))
        keys, data = stored(t, slots)
        real = os.preadv

        def eio(fd, bufs, off):  # a media error in slot 3: every read covering it fails
            if fd == t._fd and off <= 3 * sb < off + sum(len(b) for b in bufs):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(fd, bufs, off)

        monkeypatch.setattr(os, "preadv", eio)
        out, bad = read(t, slots, keys, how)
        assert bad == [3] and untouched(out[3])
        good = [0, 1, 2, 4, 5]
        assert torch.equal(out[good], data[good])
        with pytest.raises(OSError, match="no block could be read"):
            read(t, [3], [keys[3]], how)
    finally:
        monkeypatch.undo()
        t.close()


def test_a_failed_run_write_fails_the_store_naming_its_blocks(
    tmp_path, monkeypatch, direct
) -> None:
    t = open_tier(tmp_path / "nvme", direct)
    sb = t.slot_bytes
    try:
        real = os.pwrite

        def full(fd, buf, off):  # the run from slot 8 finds the disk full
            if fd == t._fd and off == 8 * sb:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, buf, off)

        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(OSError, match="writing 3 of 5 blocks failed") as info:
            stored(t, [0, 1, 8, 9, 10])
        assert info.value.errno == errno.ENOSPC
        assert t.recover() == []  # no record names any of them
    finally:
        monkeypatch.undo()
        t.close()


def test_runs_write_data_before_the_index_and_survive_a_reopen(
    tmp_path, monkeypatch, direct
) -> None:
    t = NVMeTier(
        path=str(tmp_path / "nvme"),
        block_bytes=BB,
        capacity_blocks=16,
        namespace="runs",
        direct=direct,
        fsync="always",
    )
    log: list[str] = []
    for fn in ("pwrite", "fdatasync"):
        real = getattr(os, fn)

        def traced(fd, *a, _real=real, _fn=fn):
            log.append(f"{_fn}:{ {t._fd: 'slab', t._jfd: 'index'}.get(fd, 'other') }")
            return _real(fd, *a)

        monkeypatch.setattr(os, fn, traced)
    slots = [9, 1, 2, 3, 10]  # two runs, given out of order
    keys, data = stored(t, slots)
    monkeypatch.undo()
    assert log == ["pwrite:slab"] * 2 + ["fdatasync:slab", "pwrite:index", "fdatasync:index"]
    t.close()
    t = open_tier(tmp_path / "nvme", direct)
    try:
        assert sorted(t.recover()) == sorted(zip(keys, slots, strict=True))
        out, bad = read(t, slots, keys)
        assert bad == [] and torch.equal(out, data)
    finally:
        t.close()


def test_reads_never_use_a_buffer_a_write_used(tmp_path, monkeypatch) -> None:
    """The pipeline keeps its read and write buffers apart (on the dev VM a buffer that an
    O_DIRECT write had read from took later reads at a third of the disk's rate): through
    the tier, no buffer a read used was ever used by a write, and each stack is reused."""
    from tiercache.tiers.nvme import io as nvme_io

    used: dict[bool, list[int]] = {False: [], True: []}
    real = nvme_io.SlotPipeline.run

    def spy(self, n, io, before, after, *, writes=False):  # type: ignore[no-untyped-def]
        def tagged(i, buf):  # type: ignore[no-untyped-def]
            used[writes].append(id(buf))
            return io(i, buf)

        return real(self, n, tagged, before, after, writes=writes)

    monkeypatch.setattr(nvme_io.SlotPipeline, "run", spy)
    t = NVMeTier(block_bytes=BB, capacity_blocks=64, path=str(tmp_path / "t"), namespace="n")
    try:
        keys = [i.to_bytes(16, "big") for i in range(40)]
        data = torch.randint(0, 256, (40, BB), dtype=torch.uint8)
        slots = t.allocate(keys)
        for part in (slice(0, 20), slice(20, 40)):
            t.write(slots[part], data[part], keys[part])
        for _ in range(2):
            out = torch.empty_like(data)
            assert t.read(slots, out, keys) == []
            assert torch.equal(out, data)
    finally:
        t.close()
    reads, writes = set(used[False]), set(used[True])
    assert reads and writes and not reads & writes
    assert len(reads) < len(used[False]) and len(writes) < len(used[True])  # kept, reused
