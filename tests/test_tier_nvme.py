"""NVMe tier on real files: the persistent conformance suite (batch / always / buffered), state
machines (one with restarts), restart and SIGKILL crashes in fresh processes, index damage,
disk full, fsync ordering, bad paths, and TierCache integration."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from tests.persistent_conformance import PersistentTierConformance
from tests.tier_conformance import keys_for, rand_blocks, tier_state_machine
from tests.unprivileged import as_unprivileged
from tiercache import TierCache
from tiercache.errors import ConfigError
from tiercache.tiers import format as fmt
from tiercache.tiers.nvme import NVMeTier
from tiercache.tiers.nvme import image as nvme_image
from tiercache.tiers.nvme import journal as nvme
from tiercache.tiers.nvme import tier as nvme_tier

BB = 64


def open_tier(path: Path | str, capacity: int = 8, block_bytes: int = BB, **kw) -> NVMeTier:
    return NVMeTier(
        path=str(path),
        block_bytes=block_bytes,
        capacity_blocks=capacity,
        namespace=kw.pop("namespace", "test"),
        **kw,
    )


def slot_of(store: Path, key: bytes) -> int:
    """The slot whose header holds `key`, found by scanning the slab (not the index)."""
    sb = json.loads((store / "meta.json").read_text())["slot_bytes"]
    data = (store / "slab").read_bytes()
    for slot in range(len(data) // sb):
        head = data[slot * sb : slot * sb + fmt.HEADER_SIZE]
        if head[:4] == fmt.MAGIC and fmt.decode_header(head).key == key:
            return slot
    raise AssertionError(f"key {key.hex()} is in no slot")


def flip(path: Path, offset: int, n: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))


def read_back(t: NVMeTier, pairs: list[tuple[bytes, int]]) -> tuple[torch.Tensor, list[int]]:
    out = torch.empty((len(pairs), t.block_bytes), dtype=torch.uint8)
    if not pairs:
        return out, []
    return out, t.read([s for _, s in pairs], out, [k for k, _ in pairs])


def served(t: NVMeTier) -> dict[bytes, int]:
    """key -> slot of the recovered blocks that also pass a verified read: what a cache over
    `t` would serve (an entry may be dropped at open, or only when its read fails)."""
    rec = t.recover()
    _, bad = read_back(t, rec)
    return {k: s for j, (k, s) in enumerate(rec) if j not in bad}


# -- conformance ---------------------------------------------------------------------------
class TestNVMeTier(PersistentTierConformance):
    fsync = "batch"
    direct = True

    def make_tier(self, capacity_blocks, block_bytes, tmp_path):
        return open_tier(
            tmp_path / "nvme", capacity_blocks, block_bytes, fsync=self.fsync, direct=self.direct
        )

    def corrupt(self, tmp_path, key: bytes) -> None:
        store = tmp_path / "nvme"
        sb = json.loads((store / "meta.json").read_text())["slot_bytes"]
        flip(store / "slab", slot_of(store, key) * sb + fmt.HEADER_SIZE + 5)

    def test_layout(self, tier, tmp_path) -> None:
        store = tmp_path / "nvme"
        meta = json.loads((store / "meta.json").read_text())
        assert meta["slot_bytes"] % 4096 == 0 and meta["slot_bytes"] >= fmt.HEADER_SIZE + BB
        assert (store / "slab").stat().st_size == 8 * meta["slot_bytes"]
        names = sorted(p.name for p in store.iterdir())
        assert names == ["index", "index.img", "meta.json", "slab"]
        assert tier.direct == self.direct  # ext4 here takes O_DIRECT

    def test_free_keeps_bytes_until_reused(self, tier) -> None:
        keys = keys_for(2)
        slots = tier.allocate(keys)
        data = rand_blocks(2, BB, 7)
        tier.write(slots, data, keys)
        tier.free(slots)  # a demotion planned with the eviction reads them afterwards
        out, bad = read_back(tier, list(zip(keys, slots, strict=True)))
        assert bad == [] and torch.equal(out, data)

    def test_reopen_grows_and_shrinks(self, tmp_path) -> None:
        t = self.make_tier(8, BB, tmp_path)
        keys = keys_for(6)
        slots = t.allocate(keys)
        data = rand_blocks(6, BB, 8)
        t.write(slots, data, keys)
        t.close()
        t = self.make_tier(16, BB, tmp_path)  # grow: every block back, 10 slots free
        assert sorted(s for _, s in t.recover()) == slots and t.free_blocks == 10
        t.close()
        # Shrink: the newest 4 are used; the 2 oldest are kept (opening deletes nothing),
        # neither counted nor handed out, and the slab keeps their slots.
        t = self.make_tier(4, BB, tmp_path)
        rec = t.recover()
        assert rec == list(zip(keys[2:], slots[2:], strict=True)) and t.free_blocks == 0
        assert t.open_report["blocks_over_capacity"] == 2
        out, bad = read_back(t, rec)
        assert bad == [] and torch.equal(out, data[2:])
        t.close()
        meta = json.loads((tmp_path / "nvme" / "meta.json").read_text())
        assert meta["capacity_blocks"] == 4
        assert (tmp_path / "nvme" / "slab").stat().st_size == 6 * meta["slot_bytes"]
        t = self.make_tier(8, BB, tmp_path)  # all 6 are back
        rec = t.recover()
        assert rec == list(zip(keys, slots, strict=True))
        out, bad = read_back(t, rec)
        assert bad == [] and torch.equal(out, data)
        t.free([s for _, s in rec])
        t.close()
        t = self.make_tier(4, BB, tmp_path)  # nothing held: the slab shrinks to its capacity
        t.close()
        assert (tmp_path / "nvme" / "slab").stat().st_size == 4 * meta["slot_bytes"]

    def test_order_survives_two_restarts(self, tmp_path) -> None:
        t = self.make_tier(8, BB, tmp_path)
        a, b = keys_for(2)
        t.write(t.allocate([a]), rand_blocks(1, BB), [a])
        t.close()
        t = self.make_tier(8, BB, tmp_path)
        t.recover()
        t.write(t.allocate([b]), rand_blocks(1, BB), [b])  # newer than everything recovered
        t.close()
        t = self.make_tier(8, BB, tmp_path)
        assert [k for k, _ in t.recover()] == [a, b]
        t.close()


class TestNVMeTierFsyncAlways(TestNVMeTier):
    fsync = "always"


class TestNVMeTierBuffered(TestNVMeTier):
    direct = False


# -- state machines ------------------------------------------------------------------------
class _TempTier(NVMeTier):
    """A tier in its own temporary directory, removed on close (for the state machines)."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def _temp_tier(capacity: int, block_bytes: int) -> NVMeTier:
    d = tempfile.mkdtemp(prefix="tiercache-nvme-sm-")
    return _TempTier(
        path=os.path.join(d, "nvme"),
        block_bytes=block_bytes,
        capacity_blocks=capacity,
        fsync="batch",
    )


_Machine = tier_state_machine(_temp_tier)
TestNVMeTierMachine = _Machine.TestCase


class RestartMachine(_Machine):
    """The same model, plus clean restarts: recovery gives back exactly the live slots."""

    @rule()
    def restart(self) -> None:
        path = self.tier.path
        NVMeTier.close(self.tier)  # keep the directory
        self.tier = _TempTier(
            path=path,
            block_bytes=self.tier.block_bytes,
            capacity_blocks=self.tier.capacity_blocks,
            fsync="batch",
        )
        got = {s: k for k, s in self.tier.recover()}
        assert got == {s: self.slot_key[s] for s in self.model}


RestartMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)
TestNVMeTierRestartMachine = RestartMachine.TestCase


# -- fresh processes: restart and SIGKILL mid-write ---------------------------------------
WRITER = textwrap.dedent("""
    import sys, time, torch
    from tiercache.tiers.nvme import NVMeTier
    path, cap, bb, stop, seed = sys.argv[1], *map(int, sys.argv[2:6])
    def block(i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (1, bb), dtype=torch.uint8, generator=g)
    t = NVMeTier(path=path, block_bytes=bb, capacity_blocks=cap, fsync="always",
                 namespace="crash")
    rnd = __import__("random").Random(seed)
    live = [k for k, _ in t.recover()]
    slot = dict((k, s) for k, s in t.recover())
    i = int.from_bytes(live[-1], "big") + 1 if live else 0
    while i != stop:
        n = rnd.randint(1, 3)
        while t.free_blocks < n:  # free the oldest; say so first (it may come back)
            k = live.pop(0)
            print("FREE", int.from_bytes(k, "big"), flush=True)
            t.free([slot.pop(k)])
        keys = [j.to_bytes(16, "big") for j in range(i, i + n)]
        slots = t.allocate(keys)
        t.write(slots, torch.cat([block(j) for j in range(i, i + n)]), keys)
        for k, s in zip(keys, slots):
            live.append(k)
            slot[k] = s
        print("ACK", *range(i, i + n), flush=True)  # acknowledged: write() returned
        i += n
    print("DONE", flush=True)
    time.sleep(60)
""")


def expected_block(i: int, bb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (1, bb), dtype=torch.uint8, generator=g)[0]


def run_writer(
    path: Path,
    cap: int,
    bb: int,
    *,
    stop: int = -1,
    kill_after: int = 0,
    seed: int = 0,
    delay: float = 0.0,
) -> tuple[set[int], set[int]]:
    """Run WRITER in a fresh process and SIGKILL it after `kill_after` acknowledged blocks (or
    at DONE). Returns (acknowledged, announced-as-freed) block numbers."""
    acked: set[int] = set()
    freed: set[int] = set()

    def take(line: str) -> None:
        word, *nums = line.split()
        if word in ("ACK", "FREE"):
            (acked if word == "ACK" else freed).update(map(int, nums))

    argv = [sys.executable, "-c", WRITER, str(path), str(cap), str(bb), str(stop), str(seed)]
    with (
        tempfile.TemporaryFile(mode="w+") as err,
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True) as p,
    ):
        assert p.stdout is not None
        watchdog = threading.Timer(60, p.kill)  # a hung writer fails the test, not the run
        watchdog.start()
        try:
            for line in p.stdout:
                if line.startswith("DONE"):
                    break
                take(line)
                if kill_after and len(acked) >= kill_after:
                    break
            else:
                err.seek(0)
                raise AssertionError(f"writer ended early: {err.read()}")
            time.sleep(delay)  # let it get into the next write before the kill
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
            watchdog.cancel()
        # Lines printed before the kill landed (some already in the pipe's read buffer): each
        # was printed after its write returned or before its free, so they count too.
        for line in p.stdout:
            take(line)
    return acked, freed


def check_store(path: Path, cap: int, bb: int, acked: set[int], freed: set[int]) -> int:
    """Every acknowledged, not freed block is back and identical; nothing else reads wrong."""
    t = NVMeTier(
        path=str(path), block_bytes=bb, capacity_blocks=cap, fsync="always", namespace="crash"
    )
    try:
        rec = t.recover()
        got = {int.from_bytes(k, "big"): s for k, s in rec}
        assert acked - freed <= set(got), f"lost acknowledged blocks {acked - freed - set(got)}"
        out, bad = read_back(t, rec)
        for pos, (k, _) in enumerate(rec):
            i = int.from_bytes(k, "big")
            if i in acked - freed:
                assert pos not in bad
            if pos not in bad:  # whatever is served is exactly what was written for that key
                assert torch.equal(out[pos], expected_block(i, bb)), f"block {i} differs"
        return len(rec)
    finally:
        t.close()


def test_restart_in_fresh_process_finds_acknowledged_blocks(tmp_path) -> None:
    store = tmp_path / "nvme"
    acked, freed = run_writer(store, 32, 4096 + 100, stop=20)  # SIGKILLed right after DONE
    assert acked == set(range(20)) and not freed
    assert check_store(store, 32, 4096 + 100, acked, freed) == 20


def test_restart_after_sigkill_replays_the_journal_tail_without_reading_headers(
    tmp_path,
) -> None:
    # The writer's open wrote an index image (empty store); its 20 stores are the journal
    # tail after it. A fresh open after the SIGKILL replays that tail and reads no header.
    store = tmp_path / "nvme"
    acked, _ = run_writer(store, 32, 4096 + 100, stop=20)
    t = NVMeTier(
        path=str(store), block_bytes=4096 + 100, capacity_blocks=32, fsync="always",
        namespace="crash",
    )  # fmt: skip
    try:
        assert t.open_report["index_image"] == 1 and t.open_report["headers_read"] == 0
        assert {int.from_bytes(k, "big") for k, _ in t.recover()} == acked
    finally:
        t.close()
    assert check_store(store, 32, 4096 + 100, acked, set()) == 20


def test_sigkill_mid_write_never_serves_torn_blocks(tmp_path) -> None:
    store, cap, bb = tmp_path / "nvme", 12, 128 * 1024
    rnd = random.Random(1234)
    acked: set[int] = set()
    freed: set[int] = set()
    for round_ in range(3):
        a, f = run_writer(
            store,
            cap,
            bb,
            kill_after=len(acked) + rnd.randint(4, 30),
            seed=round_,
            delay=rnd.uniform(0, 0.01),
        )
        acked |= a
        freed |= f
        check_store(store, cap, bb, acked, freed)


# -- index damage --------------------------------------------------------------------------
def _three_blocks(store: Path) -> tuple[list[bytes], list[int], torch.Tensor]:
    t = open_tier(store)
    keys = keys_for(3)
    slots = t.allocate(keys)
    data = rand_blocks(3, BB, 21)
    for i in range(3):
        t.write([slots[i]], data[i : i + 1], [keys[i]])
    t.close()
    return keys, slots, data


def test_flipped_index_record_is_skipped(tmp_path) -> None:
    store = tmp_path / "nvme"
    keys, slots, data = _three_blocks(store)
    # The compacted journal is BASE, then one PUT per block oldest first: damage the second.
    flip(store / "index", 2 * nvme.REC_SIZE + 20, 3)
    t = open_tier(store)
    try:
        assert t.open_report["records_skipped"] == 1
        rec = t.recover()
        assert rec == [(keys[0], slots[0]), (keys[2], slots[2])]
        out, bad = read_back(t, rec)
        assert bad == [] and torch.equal(out, data[[0, 2]])
    finally:
        t.close()


@pytest.mark.parametrize("cut", [1, nvme.REC_SIZE // 2, nvme.REC_SIZE + 7])
def test_truncated_index_loses_only_the_tail(tmp_path, cut: int) -> None:
    store = tmp_path / "nvme"
    keys, slots, data = _three_blocks(store)
    size = (store / "index").stat().st_size
    os.truncate(store / "index", size - cut)
    t = open_tier(store)
    try:
        rec = t.recover()
        assert rec == list(zip(keys, slots, strict=True))[: 2 if cut <= nvme.REC_SIZE else 1]
        out, bad = read_back(t, rec)
        assert bad == [] and torch.equal(out, data[: len(rec)])
    finally:
        t.close()


def test_garbage_index_recovers_nothing(tmp_path) -> None:
    store = tmp_path / "nvme"
    _three_blocks(store)
    (store / "index").write_bytes(os.urandom(1000))
    t = open_tier(store)
    try:
        assert t.recover() == [] and t.open_report["records_skipped"] == 25
        assert t.free_blocks == 8
    finally:
        t.close()


def test_damaged_records_never_serve_a_slot_under_an_old_key(tmp_path) -> None:
    store = tmp_path / "nvme"
    t = open_tier(store)
    k1, k2 = keys_for(2)
    (s,) = t.allocate([k1])
    t.write([s], rand_blocks(1, BB, 1), [k1])
    t.free([s])
    assert t.allocate([k2]) == [s]  # the same slot, rewritten under another key
    t.write([s], rand_blocks(1, BB, 2), [k2])
    journal = (store / "index").read_bytes()  # as a crash right now would leave it
    t.close()
    n = len(journal) // nvme.REC_SIZE
    # Records: BASE, PUT(k1), FREE, PUT(k2). Damage FREE and PUT(k2): the replay then sees only
    # PUT(k1) for the slot, whose header says k2, so the slot is dropped, not served as k1.
    damaged = bytearray(journal)
    for r in (n - 2, n - 1):
        damaged[r * nvme.REC_SIZE + 9] ^= 0x40
    (store / "index").write_bytes(bytes(damaged))
    t = open_tier(store)
    try:
        assert t.recover() == [] and t.open_report["blocks_dropped"] == 1
    finally:
        t.close()


def test_forged_record_with_valid_checksum_is_caught_by_the_header(tmp_path) -> None:
    store = tmp_path / "nvme"
    keys, slots, _ = _three_blocks(store)
    bogus = keys_for(1, 500)[0]
    with open(store / "index", "ab") as f:  # newest record for slot 1 names another key
        f.write(nvme.pack_record(nvme.OP_PUT, slots[1], 10**6, bogus))
        f.write(nvme.pack_record(nvme.OP_PUT, 10**6, 10**6 + 1, bogus))  # no such slot
        # Last in the file but older than slot 0's record: the highest seq wins, not the order.
        f.write(nvme.pack_record(nvme.OP_FREE, slots[0], 0, bytes(16)))
    t = open_tier(store)
    try:
        # Slot 1 is dropped at open or fails its read (the image is loaded without reading
        # headers): never served as `bogus`; the slot past the slab is dropped at open.
        assert served(t) == {keys[0]: slots[0], keys[2]: slots[2]}
        assert all(s < 8 for _, s in t.recover())
        assert t.read([slots[1]], torch.empty((1, BB), dtype=torch.uint8), [bogus]) == [0]
        t.write(t.allocate(keys_for(1, 9)), rand_blocks(1, BB), keys_for(1, 9))
        assert t.recover()[-1][0] == keys_for(1, 9)[0]  # the counter went past the forgery
    finally:
        t.close()


def test_torn_overwrite_is_never_served(tmp_path) -> None:
    store = tmp_path / "nvme"
    keys, slots, data = _three_blocks(store)
    sb = json.loads((store / "meta.json").read_text())["slot_bytes"]
    other = keys_for(1, 77)[0]
    head, _ = fmt.encode_block(other, bytes(BB), namespace=fmt.namespace_id("test"), seq=99)
    with open(store / "slab", "r+b") as f:
        # A crash mid-overwrite of slot 0 by another block: its header and half its payload
        # landed, its index record did not.
        f.seek(slots[0] * sb)
        f.write(head + bytes(BB // 2))
        # A crash mid-rewrite of slot 1 under the same key: only half the payload landed.
        f.seek(slots[1] * sb + fmt.HEADER_SIZE)
        f.write(bytes(BB // 2))
    t = open_tier(store)
    try:
        # Slot 0 (another key's header) and slot 1 (checksum mismatch) are dropped at open
        # or fail their read; slot 2 reads back exact.
        assert served(t) == {keys[2]: slots[2]}
        out, bad = read_back(t, [(keys[2], slots[2])])
        assert bad == [] and torch.equal(out[0], data[2])
    finally:
        t.close()


def test_blocks_of_another_namespace_are_kept_never_used(tmp_path) -> None:
    # One directory, two namespaces one after the other: b neither recovers, counts, reads
    # nor overwrites a's blocks (equal keys included); its capacity is other slots.
    store = tmp_path / "nvme"
    t = open_tier(store, namespace="a")
    keys = keys_for(2)
    slots = t.allocate(keys)
    data = rand_blocks(2, BB, 95)
    t.write(slots, data, keys)
    t.close()
    t = open_tier(store, namespace="b")
    try:
        assert t.recover() == [] and t.used_blocks == 0 and t.free_blocks == 8
        assert t.open_report["blocks_of_other_namespaces"] == 2
        out = torch.empty((2, BB), dtype=torch.uint8)
        with pytest.raises(ValueError, match="not a slot of this tier"):
            t.read(slots, out, keys)  # a's slots are not b's to read
        mine = t.allocate(keys_for(8))
        assert not set(mine) & set(slots)
        t.write(mine, rand_blocks(8, BB, 96), keys_for(8))  # equal keys, other slots
    finally:
        t.close()
    t = open_tier(store, namespace="a")
    try:
        rec = t.recover()
        assert rec == list(zip(keys, slots, strict=True))
        out, bad = read_back(t, rec)
        assert bad == [] and torch.equal(out, data)
    finally:
        t.close()


# -- the index image ------------------------------------------------------------------------
def _count_slab_reads(monkeypatch) -> list[int]:
    """Patch os.preadv to record the offset of every read; returns the list it fills."""
    offsets: list[int] = []
    real = os.preadv

    def counting(fd, bufs, offset):
        offsets.append(offset)
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", counting)
    return offsets


def test_open_after_close_uses_the_image_and_reads_no_slot(tmp_path, monkeypatch) -> None:
    store = tmp_path / "nvme"
    keys, slots, data = _three_blocks(store)
    reads = _count_slab_reads(monkeypatch)
    t = open_tier(store, direct=False)  # buffered: no O_DIRECT probe read either
    try:
        assert reads == []  # neither headers nor payloads
        assert t.open_report["index_image"] == 1 and t.open_report["headers_read"] == 0
        assert t.recover() == list(zip(keys, slots, strict=True))
        monkeypatch.undo()
        out, bad = read_back(t, t.recover())
        assert bad == [] and torch.equal(out, data)
    finally:
        t.close()


def test_blocks_stored_after_the_image_are_found_after_a_crash(tmp_path) -> None:
    store, crashed = tmp_path / "nvme", tmp_path / "crashed"
    keys, slots, data = _three_blocks(store)
    t = open_tier(store)
    more = keys_for(3, 100)
    more_slots = t.allocate(more)
    more_data = rand_blocks(3, BB, 22)
    t.write(more_slots, more_data, more)
    t.free([slots[0]])
    t.flush()
    shutil.copytree(store, crashed)  # the files as a crash right now would leave them
    t.close()
    t = open_tier(crashed)
    try:
        assert t.open_report["index_image"] == 1 and t.open_report["headers_read"] == 0
        rec = t.recover()
        assert rec == [*zip(keys[1:], slots[1:], strict=True), *zip(more, more_slots, strict=True)]
        out, bad = read_back(t, rec)
        assert bad == [] and torch.equal(out, torch.cat([data[1:], more_data]))
    finally:
        t.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "stale", "delete"])
def test_a_damaged_or_stale_image_falls_back_to_the_headers(tmp_path, damage: str) -> None:
    store = tmp_path / "nvme"
    t = open_tier(store)
    t.close()
    old_image = (store / "index.img").read_bytes()  # the empty store's image
    keys, slots, data = _three_blocks(store)
    img = store / "index.img"
    if damage == "flip":
        flip(img, 30)
    elif damage == "truncate":
        os.truncate(img, img.stat().st_size - 3)
    elif damage == "stale":
        img.write_bytes(old_image)  # valid, but it covers another journal
    else:
        img.unlink()
    t = open_tier(store)
    try:
        assert t.open_report["index_image"] == 0 and t.open_report["headers_read"] == 3
        rec = t.recover()
        assert rec == list(zip(keys, slots, strict=True))
        out, bad = read_back(t, rec)
        assert bad == [] and torch.equal(out, data)
    finally:
        t.close()
    t = open_tier(store)  # that open wrote a fresh image
    try:
        assert t.open_report["index_image"] == 1 and len(t.recover()) == 3
    finally:
        t.close()


def test_image_names_its_writer_namespace(tmp_path) -> None:
    # a writes, then b opens (its own image) and stores after it; a "crash" of b: a's
    # blocks stay a's (kept by b), b's tail blocks are b's.
    store, crashed = tmp_path / "nvme", tmp_path / "crashed"
    t = open_tier(store, namespace="a")
    ka = keys_for(2)
    t.write(t.allocate(ka), rand_blocks(2, BB, 1), ka)
    t.close()
    t = open_tier(store, namespace="b")
    kb = keys_for(2, 50)
    t.write(t.allocate(kb), rand_blocks(2, BB, 2), kb)
    t.flush()
    shutil.copytree(store, crashed)
    t.close()
    for ns, want in (("b", kb), ("a", ka)):
        t = open_tier(crashed, namespace=ns)
        try:
            assert t.open_report["headers_read"] == 0
            assert [k for k, _ in t.recover()] == want
            assert t.open_report["blocks_of_other_namespaces"] == 2
            _, bad = read_back(t, t.recover())
            assert bad == []
        finally:
            t.close()


def test_fuzz_like_images_never_load(tmp_path) -> None:
    store = tmp_path / "nvme"
    _three_blocks(store)
    good = (store / "index.img").read_bytes()
    assert nvme_image.decode_image(good) is not None
    rnd = random.Random(5)
    for _ in range(200):
        bad = bytearray(good)
        for _ in range(rnd.randint(1, 3)):
            bad[rnd.randrange(len(bad))] ^= 1 << rnd.randrange(8)
        assert nvme_image.decode_image(bytes(bad)) is None
        assert nvme_image.decode_image(bytes(bad[: rnd.randrange(len(bad))])) is None


# -- disk full and I/O errors --------------------------------------------------------------
def test_enospc_on_data_fails_the_store_and_keeps_the_rest(tmp_path, monkeypatch) -> None:
    store = tmp_path / "nvme"
    t = open_tier(store)
    keys = keys_for(3)
    slots = t.allocate(keys)
    data = rand_blocks(3, BB, 31)
    t.write(slots, data, keys)
    real = os.pwrite

    def full(fd, buf, off):
        if fd == t._fd and off != slots[0] * t.slot_bytes:  # the first block goes through
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buf, off)

    monkeypatch.setattr(os, "pwrite", full)
    new = keys_for(3, 10)
    new_slots = t.allocate(new)
    with pytest.raises(OSError) as info:
        t.write([slots[0], *new_slots], rand_blocks(4, BB, 32), [keys[0], *new])
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    t.free(new_slots)  # what the manager does after a failed store
    out, bad = read_back(t, list(zip(keys, slots, strict=True))[1:])
    assert bad == [] and torch.equal(out, data[1:])
    t.close()
    t = open_tier(store)
    try:  # the half-written slot 0 is still indexed under its old write, whose header now
        # carries the newer seq: dropped at open or failed at read, never served
        assert served(t) == dict(zip(keys[1:], slots[1:], strict=True))
        out, bad = read_back(t, list(zip(keys[1:], slots[1:], strict=True)))
        assert bad == [] and torch.equal(out, data[1:])
    finally:
        t.close()


def test_enospc_on_index_append_keeps_records_aligned(tmp_path, monkeypatch) -> None:
    store = tmp_path / "nvme"
    t = open_tier(store, fsync="always")
    a, b, c = keys_for(3)
    data = rand_blocks(3, BB, 41)
    sa = t.allocate([a])
    t.write(sa, data[0:1], [a])
    real = os.pwrite
    calls = {"n": 0}

    def full(fd, buf, off):
        if fd == t._jfd:
            calls["n"] += 1
            if calls["n"] == 1:
                return real(fd, bytes(buf)[:17], off)  # a partial record lands, then ENOSPC
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, buf, off)

    monkeypatch.setattr(os, "pwrite", full)
    sb_ = t.allocate([b])
    with pytest.raises(OSError, match="No space"):
        t.write(sb_, data[1:2], [b])
    monkeypatch.undo()
    t.free(sb_)
    sc = t.allocate([c])
    t.write(sc, data[2:3], [c])  # appends on a record boundary again
    t.close()
    t = open_tier(store)
    try:
        assert t.open_report["records_skipped"] == 0
        rec = t.recover()
        assert [k for k, _ in rec] == [a, c]
        out, bad = read_back(t, rec)
        assert bad == [] and torch.equal(out, data[[0, 2]])
    finally:
        t.close()


def test_eio_on_read_is_a_failed_position(tmp_path, monkeypatch) -> None:
    t = open_tier(tmp_path / "nvme")
    keys = keys_for(3)
    slots = t.allocate(keys)
    data = rand_blocks(3, BB, 51)
    t.write(slots, data, keys)
    real = os.preadv

    def eio(fd, bufs, off):  # a media error in slot 1: every read that covers it fails
        if off <= slots[1] * t.slot_bytes < off + sum(len(b) for b in bufs):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", eio)
    try:  # the three slots are adjacent: their run fails, then each is read alone
        out, bad = read_back(t, list(zip(keys, slots, strict=True)))
        assert bad == [1] and torch.equal(out[[0, 2]], data[[0, 2]])
        with pytest.raises(OSError):  # nothing could be read at all
            read_back(t, [(keys[1], slots[1])])
    finally:
        monkeypatch.undo()
        t.close()


def test_disk_full_through_the_cache(tmp_path, monkeypatch) -> None:
    with TierCache.open(cache_cfg(tmp_path / "nvme", "t"), block_bytes=4096) as cache:
        nv = cache.tiers[1]
        real = os.pwrite

        def full(fd, buf, off):
            if fd == nv._fd:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, buf, off)

        monkeypatch.setattr(os, "pwrite", full)
        keys = cache.hash_tokens(list(range(48)))  # 12 blocks through a 4-block CPU tier
        blocks = rand_blocks(12, 4096, 61)
        for i in range(0, 12, 4):
            cache.put(keys[i : i + 4], blocks[i : i + 4])
        s = cache.stats()
        assert s["nvme"]["errors"] > 0 and s["nvme"]["used_blocks"] == 0
        assert torch.equal(cache.get(keys[8:]), blocks[8:])  # the CPU tier keeps serving
        monkeypatch.undo()


# -- fsync policy and ordering -------------------------------------------------------------
def _trace(monkeypatch, t: NVMeTier) -> list[str]:
    """Record pwrite / fdatasync / fsync calls on the tier's files, in order."""
    log: list[str] = []
    names = lambda fd: {t._fd: "slab", t._jfd: "index"}.get(fd, "other")  # noqa: E731
    for fn in ("pwrite", "fdatasync", "fsync"):
        real = getattr(os, fn)

        def traced(fd, *a, _real=real, _fn=fn):
            log.append(f"{_fn}:{names(fd)}")
            return _real(fd, *a)

        monkeypatch.setattr(os, fn, traced)
    return log


def test_always_orders_data_sync_before_index(tmp_path, monkeypatch) -> None:
    t = open_tier(tmp_path / "nvme", fsync="always")
    keys = keys_for(3)
    slots = t.allocate(keys)
    log = _trace(monkeypatch, t)
    t.write(slots, rand_blocks(3, BB), keys)
    monkeypatch.undo()
    t.close()
    # the three slots are adjacent: one pwrite of their run, synced before any record
    assert log == ["pwrite:slab", "fdatasync:slab", "pwrite:index", "fdatasync:index"]


def test_batch_syncs_by_count_and_by_timer(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(nvme_tier, "BATCH_SYNC_SECONDS", 0.05)
    t = open_tier(tmp_path / "nvme", capacity=16)
    monkeypatch.setattr(nvme_tier, "BATCH_SYNC_BYTES", 4 * t._slot_bytes)  # 4 blocks' slots
    log = _trace(monkeypatch, t)
    t.write(t.allocate(keys_for(2)), rand_blocks(2, BB), keys_for(2))
    assert "fdatasync:slab" not in log  # 2 < 4 blocks: not yet ...
    deadline = time.monotonic() + 5
    while "fdatasync:index" not in log and time.monotonic() < deadline:
        time.sleep(0.01)
    assert log[-2:] == ["fdatasync:slab", "fdatasync:index"]  # ... until the timer fired
    log.clear()
    t.write(t.allocate(keys_for(5, 10)), rand_blocks(5, BB), keys_for(5, 10))
    assert log[-2:] == ["fdatasync:slab", "fdatasync:index"]  # 5 >= 4 blocks: right away
    monkeypatch.undo()
    t.close()


def test_never_calls_no_fsync(tmp_path, monkeypatch) -> None:
    t = open_tier(tmp_path / "nvme", fsync="never")
    log = _trace(monkeypatch, t)
    keys = keys_for(4)
    slots = t.allocate(keys)
    t.write(slots, rand_blocks(4, BB), keys)
    t.free(slots[:1])
    t.flush()
    t.close()
    monkeypatch.undo()
    assert not [c for c in log if "sync" in c]


def test_journal_is_compacted_while_running(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(nvme_tier, "COMPACT_SLACK", 0)
    store = tmp_path / "nvme"
    t = open_tier(store, capacity=4)
    data = rand_blocks(60, BB, 71)
    for i in range(60):  # 60 puts and 56 frees through 4 slots
        k = keys_for(1, i)
        if t.free_blocks == 0:
            t.free([t.recover()[0][1]])  # the oldest block
        t.write(t.allocate(k), data[i : i + 1], k)
        assert (store / "index").stat().st_size <= (2 * 4 + 2) * nvme.REC_SIZE
    t.close()
    t = open_tier(store, capacity=4)
    try:
        rec = t.recover()
        assert [k for k, _ in rec] == keys_for(4, 56)
        out, bad = read_back(t, rec)
        assert bad == [] and torch.equal(out, data[56:])
    finally:
        t.close()


# -- O_DIRECT fallback ---------------------------------------------------------------------
def test_falls_back_to_buffered_when_open_refuses_o_direct(tmp_path, monkeypatch) -> None:
    real = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_direct)
    with pytest.warns(RuntimeWarning, match="O_DIRECT") as caught:
        t = open_tier(tmp_path / "nvme")
    monkeypatch.undo()
    assert len(caught) == 1 and t.direct is False
    keys = keys_for(2)
    slots = t.allocate(keys)
    data = rand_blocks(2, BB)
    t.write(slots, data, keys)
    out, bad = read_back(t, list(zip(keys, slots, strict=True)))
    t.close()
    assert bad == [] and torch.equal(out, data)


def test_falls_back_when_o_direct_io_is_refused(tmp_path, monkeypatch) -> None:
    real = os.preadv

    def refuse(fd, bufs, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = open_tier(tmp_path / "nvme")
    try:
        assert t.direct is False and len(caught) == 1
        keys = keys_for(1)
        t.write(t.allocate(keys), rand_blocks(1, BB), keys)
        assert read_back(t, [(keys[0], 0)])[1] == []
    finally:
        monkeypatch.undo()
        t.close()


# -- bad paths and options -----------------------------------------------------------------
def test_bad_paths_are_refused_naming_path(tmp_path) -> None:
    cases: list[tuple[Path, str]] = []
    cases.append((tmp_path / "missing" / "nvme", "parent"))
    (tmp_path / "afile").write_text("x")
    cases.append((tmp_path / "afile", "not a directory"))
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    (foreign / "data.db").write_text("someone else's")
    cases.append((foreign, "another program"))
    open_ = tmp_path / "open"
    open_.mkdir()
    open_.chmod(0o777)
    cases.append((open_, "writable by group or others"))
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(other, 12345, 12345)
        cases.append((other, "owned by uid 12345"))
    notjson = tmp_path / "notjson"
    notjson.mkdir(mode=0o700)
    (notjson / "meta.json").write_text("{not json")
    cases.append((notjson, "unreadable tiercache metadata"))
    alien = tmp_path / "alien"
    alien.mkdir(mode=0o700)
    (alien / "meta.json").write_text('{"format": "something-else"}')
    cases.append((alien, "not describe a tiercache NVMe store"))
    for path, why in cases:
        with pytest.raises(ConfigError, match=why) as info:
            open_tier(path)
        assert str(info.value).startswith("path:"), str(info.value)
    assert sorted(os.listdir(foreign)) == ["data.db"]  # nothing written into foreign dirs


def test_unwritable_dir_is_refused() -> None:
    def check(base: Path) -> None:  # as a user whose permission bits apply (not root)
        ro = base / "ro"
        ro.mkdir(mode=0o500)
        try:
            with pytest.raises(ConfigError, match="not readable and writable"):
                open_tier(ro)
            assert os.listdir(ro) == []
        finally:
            ro.chmod(0o700)

    as_unprivileged(check)


def test_one_tier_per_directory(tmp_path) -> None:
    t = open_tier(tmp_path / "nvme")
    try:
        with pytest.raises(ConfigError, match="in use"):
            open_tier(tmp_path / "nvme")
    finally:
        t.close()
    open_tier(tmp_path / "nvme").close()  # released on close


def test_new_directory_is_private(tmp_path) -> None:
    open_tier(tmp_path / "nvme").close()
    assert (tmp_path / "nvme").stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "nvme").iterdir())


@pytest.mark.parametrize(
    "bad,field",
    [
        ({"path": None}, "path"),  # None: left out
        ({"path": ""}, "path"),
        ({"fsync": "sometimes"}, "fsync"),
        ({"io_threads": 0}, "io_threads"),
        ({"io_threads": 65}, "io_threads"),
        ({"direct": "yes"}, "direct"),
    ],
)
def test_bad_options_name_the_field(tmp_path, bad: dict, field: str) -> None:
    tier = {"kind": "nvme", "blocks": 8, "path": str(tmp_path / "nvme"), **bad}
    tier = {k: v for k, v in tier.items() if v is not None}
    with pytest.raises(ConfigError, match=rf"tiers\[1\]\.{field}"):
        TierCache.open({"tiers": [{"kind": "cpu", "blocks": 2}, tier]}, block_bytes=BB)


def test_bad_path_through_config_names_the_tier(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.path: .*parent"):
        TierCache.open(cache_cfg(tmp_path / "no" / "nvme", "t"), block_bytes=4096)


def test_bad_write_arguments(tmp_path) -> None:
    t = open_tier(tmp_path / "nvme")
    try:
        keys = keys_for(2)
        with pytest.raises(ValueError, match="keys"):
            t.write([0, 1], rand_blocks(2, BB), keys[:1])
        with pytest.raises(ValueError, match="keys"):
            t.read([0, 1], torch.empty((2, BB), dtype=torch.uint8), None)
        with pytest.raises(ValueError, match="slots"):
            t.write([0, 8], rand_blocks(2, BB), keys)
        with pytest.raises(ValueError, match="same slot"):
            t.write([3, 3], rand_blocks(2, BB), keys)
    finally:
        t.close()
    with pytest.raises(OSError, match="closed"):
        t.write([0], rand_blocks(1, BB), keys_for(1))


# -- TierCache integration -----------------------------------------------------------------
def cache_cfg(path: Path, namespace: str) -> dict:
    return {
        "block_size": 4,
        "namespace": namespace,
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            # write-back: these tests follow demotions (write-through has tests of its own)
            {"kind": "nvme", "blocks": 64, "path": str(path), "write_policy": "write-back"},
        ],
    }


def test_cache_demotes_to_nvme_and_finds_it_after_reopen(tmp_path) -> None:
    store = tmp_path / "nvme"
    tokens = list(range(1000, 1048))
    with TierCache.open(cache_cfg(store, "t"), block_bytes=4096) as cache:
        keys = cache.hash_tokens(tokens)  # 12 blocks through a 4-block CPU tier
        blocks = rand_blocks(12, 4096, 81)
        for i in range(0, 12, 4):
            cache.put(keys[i : i + 4], blocks[i : i + 4])
        s = cache.stats()
        assert s["cpu"]["used_blocks"] == 4 and s["nvme"]["used_blocks"] == 8
        assert torch.equal(cache.get(keys), blocks)  # the first 8 come from the slab
    # close wrote the CPU-only blocks down too; a new process-like open finds all 12.
    with TierCache.open(cache_cfg(store, "t"), block_bytes=4096) as cache:
        assert cache.hash_tokens(tokens) == keys
        assert cache.lookup(keys) == 12 and cache.stats()["nvme"]["used_blocks"] == 12
        assert torch.equal(cache.get(keys), blocks)
    with TierCache.open(cache_cfg(store, "other"), block_bytes=4096) as cache:
        assert cache.lookup(cache.hash_tokens(tokens)) == 0


def test_corrupt_block_on_disk_is_a_miss_through_the_cache(tmp_path) -> None:
    store = tmp_path / "nvme"
    tokens = list(range(32))
    with TierCache.open(cache_cfg(store, "t"), block_bytes=4096) as cache:
        keys = cache.hash_tokens(tokens)
        blocks = rand_blocks(8, 4096, 91)
        cache.put(keys[:4], blocks[:4])
        cache.put(keys[4:], blocks[4:])  # the first four go down to the slab
    sb = json.loads((store / "meta.json").read_text())["slot_bytes"]
    flip(store / "slab", slot_of(store, keys[2]) * sb + fmt.HEADER_SIZE + 100)
    with TierCache.open(cache_cfg(store, "t"), block_bytes=4096) as cache:
        got = cache.get(keys)
        assert got.shape[0] == 2 and torch.equal(got, blocks[:2])  # stops at the bad block
        assert cache.stats()["nvme"]["errors"] == 1
        assert cache.lookup(keys) == 2


@settings(max_examples=200, deadline=None)
@given(
    records=st.lists(
        st.tuples(
            st.sampled_from([nvme.OP_PUT, nvme.OP_FREE, nvme.OP_BASE]),
            st.integers(0, 9),
            st.integers(1, 12),
            st.integers(0, 3),
            st.booleans(),
        ),
        max_size=30,
    ),
    torn=st.binary(max_size=nvme.REC_SIZE - 1),
)
def test_tail_arrays_replay_as_the_journal_replay(records, torn) -> None:
    # The open's array replay of a journal tail picks, per slot, the record the plain
    # replay picks (damaged records skipped, equal seqs: the first), with the same counts.
    journal = bytearray()
    for op, slot, seq, kid, bad in records:
        rec = bytearray(nvme.pack_record(op, slot, seq, bytes([kid]) * 16))
        if bad:
            rec[3] ^= 0x10
        journal += rec
    data = bytes(journal) + torn
    entries, report = nvme.replay_journal(data, 10, per_key=False)
    t, damaged, top = nvme.tail_records(data)
    puts = t.ns == nvme.OP_PUT
    got = set(
        zip(t.slots[puts].tolist(), t.keys[puts].tolist(), t.seqs[puts].tolist(), strict=True)
    )
    assert got == {(e.slot, e.key, e.seq) for e in entries}
    assert (damaged, top) == (report.damaged, report.top_seq)


def test_a_key_put_twice_after_the_image_is_recovered_once(tmp_path) -> None:
    # The image says its entries hold one per key (checked at compaction); a journal tail
    # that puts a key it holds into another slot (as a lost FREE record leaves it) must
    # still be deduplicated at open: the newer copy is recovered, once.
    store, crashed = tmp_path / "nvme", tmp_path / "crashed"
    key, data = keys_for(1), rand_blocks(2, BB, 31)
    t = open_tier(store, fsync="always")
    t.write(t.allocate(key), data[:1], key)
    t.close()
    t = open_tier(store, fsync="always")
    try:
        assert t.open_report["index_image"] == 1
        t.write(t.allocate(key), data[1:], key)  # a second slot, the first not freed
        shutil.copytree(store, crashed)  # the files as a SIGKILL here would leave them
    finally:
        t.close()
    t = open_tier(crashed)
    try:
        rec = t.recover()
        assert [k for k, _ in rec] == key and t.used_blocks == 1
        assert t.open_report["blocks_dropped"] == 1
        out, bad = read_back(t, rec)
        assert bad == [] and torch.equal(out, data[1:])
    finally:
        t.close()
