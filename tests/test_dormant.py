"""Dormant blocks (issue 21): a reopened persistent tier's blocks stay in the tier's arrays
(tiers/dormant.py) and the manager keeps no state for them until a lookup or a store
reaches their key, or the tier needs their slots. Unit tests of `DormantIndex`, scenarios on
a real NVMe tier under the manager and the facade, and a hypothesis state machine with
reopens: never wrong bytes, no slot held twice, nothing acknowledged lost while it fits."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tiercache import TierCache
from tiercache.manager import OffloadingManager
from tiercache.policies import ARCPolicy, LRUPolicy
from tiercache.tiers.cpu import CPUTier
from tiercache.tiers.dormant import DormantIndex
from tiercache.tiers.nvme import NVMeTier

BB = 64


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


def keycol(keys: list[bytes], nslots: int) -> np.ndarray:
    col = np.zeros(nslots, dtype=np.dtype("V16"))
    col[: len(keys)] = np.frombuffer(b"".join(keys), dtype=np.dtype("V16"))
    return col


# -- DormantIndex ---------------------------------------------------------------------------
def test_find_wake_and_wake_oldest() -> None:
    keys = [os.urandom(16) for _ in range(100)]
    col = keycol(keys, 120)
    order = np.arange(100)[::-1].copy()  # slot 99 is the oldest
    d = DormantIndex(col, order)
    assert d.n == 100 and d.open_keys() == keys[::-1]
    probe = [keys[5], os.urandom(16), keys[99], b"short", keys[5]]
    assert d.find(probe[:3]) == [5, -1, 99]
    assert d.find(probe) == [-1] * 5  # a key of another width is never a tier's
    d.wake([5])
    assert d.find([keys[5], keys[6]]) == [-1, 6] and d.n == 99
    got_keys, got_slots = d.wake_oldest(3)
    assert got_slots == [99, 98, 97] and got_keys == [keys[99], keys[98], keys[97]]
    assert d.find([keys[99]]) == [-1] and d.n == 96
    # The oldest still dormant skip the woken slot 5; asking for more than are left gives all.
    rest_keys, rest = d.wake_oldest(1000)
    assert rest == [s for s in range(96, -1, -1) if s != 5] and d.n == 0
    assert rest_keys == [keys[s] for s in rest]
    assert d.find(keys) == [-1] * 100 and d.wake_oldest(5) == ([], [])
    # open_keys lists every key recovered at open, woken or not.
    assert d.open_keys() == keys[::-1]


def test_keys_sharing_their_first_word_are_told_apart() -> None:
    a, b, c = b"\x01" * 8 + b"A" * 8, b"\x01" * 8 + b"B" * 8, b"\x01" * 8 + b"C" * 8
    d = DormantIndex(keycol([a, b, c], 3), np.array([0, 1, 2]))
    assert d.find([c, b, a, b"\x01" * 8 + b"D" * 8]) == [2, 1, 0, -1]
    d.wake([0])
    assert d.find([a, b, c]) == [-1, 1, 2]
    d.wake([1])
    assert d.find([a, b, c]) == [-1, -1, 2]


def test_waking_a_slot_twice_is_refused() -> None:
    d = DormantIndex(keycol([K(1), K(2)], 2), np.array([0, 1]))
    d.wake([1])
    try:
        d.wake([1])
    except ValueError as exc:
        assert "not dormant" in str(exc)
    else:
        raise AssertionError("a second wake of one slot must fail")
    assert d.n == 1


# -- the manager over a reopened NVMe tier ---------------------------------------------------
def nvme(path, cap: int) -> NVMeTier:
    return NVMeTier(path=str(path), block_bytes=BB, capacity_blocks=cap, namespace="t")


def rows(keys: list[bytes]) -> torch.Tensor:
    return torch.stack([torch.frombuffer(bytearray((k * 4)[:BB]), dtype=torch.uint8) for k in keys])


def fill(path, cap: int, keys: list[bytes]) -> None:
    t = nvme(path, cap)
    m = OffloadingManager([t], [LRUPolicy(cap)])
    for i in range(0, len(keys), 4):  # oldest first
        part = keys[i : i + 4]
        out = m.prepare_store(part)
        t.write(list(out.store_spec.slots), rows(part), part)
        m.complete_store(part)
    t.close()


def read(m: OffloadingManager, keys: list[bytes]) -> torch.Tensor:
    spec = m.prepare_load(keys)
    out = torch.empty((len(keys), BB), dtype=torch.uint8)
    assert m.tiers[0].read(list(spec.slots), out, keys) == []
    m.complete_load(keys)
    return out


def test_reopen_keeps_no_state_per_block_and_wakes_what_is_asked(tmp_path) -> None:
    keys = [K(i) for i in range(40)]
    fill(tmp_path / "s", 40, keys)
    t = nvme(tmp_path / "s", 40)
    m = OffloadingManager([t], [LRUPolicy(40)])
    s = m.stats()["nvme"]
    assert (s["dormant_blocks"], s["ready_blocks"], s["used_blocks"]) == (40, 40, 40)
    assert m._ready == {} and len(m.policies[0]) == 0  # nothing per block in the manager
    # A lookup wakes the chain it reaches, no more; where() sees it afterwards.
    assert m.lookup([*keys[10:14], K(999)]) == 4
    assert m.where(keys[10]) == [0] and m.stats()["nvme"]["dormant_blocks"] == 36
    assert len(m.policies[0]) == 4
    # where() wakes the block it is asked about (adapters verify or drop what it names).
    assert m.where(keys[20]) == [0] and m.where(K(999)) == []
    assert m.stats()["nvme"]["dormant_blocks"] == 35
    assert torch.equal(read(m, keys[10:14]), rows(keys[10:14]))
    # holds and count_ready see dormant blocks without waking them.
    assert m.holds(keys[30]) and not m.holds(K(999))
    assert m.count_ready([keys[30], keys[10], K(999)]) == 2
    assert m.stats()["nvme"]["dormant_blocks"] == 35
    # A store of held keys stores nothing again (a dormant one is woken, not rewritten).
    out = m.prepare_store([keys[30], keys[10], K(100)])
    assert out.keys_to_store == (K(100),) and out.evicted_keys == (keys[0],)
    t.write(list(out.store_spec.slots), rows([K(100)]), [K(100)])
    m.complete_store([K(100)])
    assert torch.equal(read(m, [keys[30], K(100)]), rows([keys[30], K(100)]))
    t.close()


def test_eviction_takes_the_oldest_dormant_blocks_first(tmp_path) -> None:
    keys = [K(i) for i in range(16)]
    for policy in (LRUPolicy, ARCPolicy):
        path = tmp_path / policy.__name__
        fill(path, 16, keys)
        t = nvme(path, 16)
        m = OffloadingManager([t], [policy(16)])
        assert m.lookup(keys[:2]) == 2  # the two oldest are used again: no longer the coldest
        new = [K(100 + i) for i in range(3)]
        out = m.prepare_store(new)
        assert out.evicted_keys == tuple(keys[2:5])
        m.complete_store(new, success=False)
        assert m.lookup(keys[:2]) == 2 and m.lookup(keys[2:3]) == 0
        assert m.stats()["nvme"]["used_blocks"] == 13
        t.close()


def test_open_event_keeps_its_place_and_its_keys(tmp_path) -> None:
    keys = [K(i) for i in range(8)]
    fill(tmp_path / "s", 8, keys)
    t = nvme(tmp_path / "s", 8)
    m = OffloadingManager([t], [LRUPolicy(8)])
    # Before any event is taken, an eviction reuses recovered slots: the open event still
    # lists the keys recovered, first, and the removal follows it.
    out = m.prepare_store([K(50), K(51)])
    t.write(list(out.store_spec.slots), rows([K(50), K(51)]), [K(50), K(51)])
    m.complete_store([K(50), K(51)])
    events = m.take_events()
    assert [(e.keys, e.removed) for e in events] == [
        (tuple(keys), False),
        (tuple(keys[:2]), True),
        ((K(50), K(51)), False),
    ]
    assert m.take_events() == []
    t.close()


def test_two_tiers_demotion_into_a_full_dormant_tier(tmp_path) -> None:
    keys = [K(i) for i in range(12)]
    fill(tmp_path / "s", 12, keys)
    cpu = CPUTier(block_bytes=BB, capacity_blocks=2)
    t = nvme(tmp_path / "s", 12)
    m = OffloadingManager([cpu, t], [LRUPolicy(2), LRUPolicy(12)])
    # keys[5] is dormant below: storing it stores nothing; a new chain fills the CPU tier.
    out = m.prepare_store([keys[5], K(200), K(201)])
    assert out.keys_to_store == (K(200), K(201)) and m.where(keys[5]) == [1]
    cpu.write(list(out.store_spec.slots), rows([K(200), K(201)]))
    m.complete_store([K(200), K(201)])
    # The next store evicts the CPU blocks into the full NVMe tier, which makes room by
    # evicting its two oldest dormant blocks.
    out = m.prepare_store([K(300), K(301)])
    (mv,) = out.moves
    assert set(mv.keys) == {K(200), K(201)} and m.stats()["nvme"]["evictions"] == 2
    assert m.lookup(keys[:2]) == 0 and m.lookup(keys[2:4]) == 2
    data = torch.empty((2, BB), dtype=torch.uint8)
    cpu.read(list(mv.src.slots), data)
    t.write(list(mv.dst.slots), data, list(mv.keys))
    m.complete_store(mv.keys)
    cpu.write(list(out.store_spec.slots), rows([K(300), K(301)]))
    m.complete_store([K(300), K(301)])
    spec = m.prepare_load([K(200), K(201)])
    assert spec.tiers == (1, 1)
    m.complete_load([K(200), K(201)])
    t.close()


def test_facade_reopen_reads_back_exact(tmp_path) -> None:
    cfg = {
        "block_size": 4,
        "namespace": "m/fp32/tp1/0",
        "tiers": [{"kind": "nvme", "blocks": 32, "path": str(tmp_path / "n")}],
    }
    tokens = list(range(4 * 24))
    with TierCache.open(cfg, block_bytes=BB) as cache:
        keys = cache.hash_tokens(tokens)
        data = torch.randint(0, 256, (24, BB), dtype=torch.uint8)
        assert cache.put(keys, data) == 24
    with TierCache.open(cfg, block_bytes=BB) as cache:
        assert cache.stats()["nvme"]["dormant_blocks"] == 24
        assert cache.lookup(keys) == 24 and torch.equal(cache.get(keys), data)
        assert cache.put(keys, torch.zeros_like(data)) == 24  # held: not rewritten
        assert torch.equal(cache.get(keys), data)


# -- a state machine with reopens ------------------------------------------------------------
class ReopenMachine(RuleBasedStateMachine):
    """A CPU tier over an NVMe tier, reopened at random: whatever `get` returns is what `put`
    stored; each NVMe slot is held once (by the manager or dormant) and the tier's count of
    used slots is exactly that; a reopen loses nothing the NVMe tier held."""

    @initialize(policy=st.sampled_from(["lru", "arc"]), cpu=st.integers(1, 3))
    def start(self, policy: str, cpu: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="tiercache-dormant-")
        self.cfg = {
            "block_size": 2,
            "namespace": "m/fp32/tp1/0",
            "tiers": [
                {"kind": "cpu", "blocks": cpu, "policy": policy},
                {"kind": "nvme", "blocks": 6, "policy": policy, "path": self.dir + "/n"},
            ],
        }
        self.cache = TierCache.open(self.cfg, block_bytes=BB)
        self.truth: dict[bytes, bytes] = {}

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.cache.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def keys(self, seed: int, n: int) -> list[bytes]:
        return self.cache.hash_tokens([seed * 1000 + i for i in range(2 * n)])

    @rule(seed=st.integers(0, 6), n=st.integers(1, 4))
    def put(self, seed: int, n: int) -> None:
        keys = self.keys(seed, n)
        blocks = torch.randint(0, 256, (n, BB), dtype=torch.uint8)
        before = {k for k in keys if self.cache.manager.holds(k)}
        self.cache.put(keys, blocks)
        for k, row in zip(keys, blocks, strict=True):
            if k not in before and self.cache.manager.holds(k):
                self.truth[k] = row.numpy().tobytes()

    @rule(seed=st.integers(0, 6), n=st.integers(1, 4))
    def get(self, seed: int, n: int) -> None:
        keys = self.keys(seed, n)
        got = self.cache.get(keys)
        for key, row in zip(keys, got, strict=False):
            assert row.numpy().tobytes() == self.truth[key]

    @rule()
    def reopen(self) -> None:
        m = self.cache.manager
        held = set(m._levels[0].slots) | set(m._levels[1].slots)
        held |= {k for k, _ in m.tiers[1].recover()}
        self.cache.close()
        self.cache = TierCache.open(self.cfg, block_bytes=BB)
        nvme = self.cache.manager.tiers[1]
        # The close ran the queued write-through copies (evicting through the policy) and
        # wrote back what only the CPU held: the tier holds some of what was held, all
        # dormant.
        after = {k for k, _ in nvme.recover()}
        assert after <= held and nvme.dormant_blocks == len(after)

    @invariant()
    def slots_held_once(self) -> None:
        if not hasattr(self, "cache"):
            return
        with self.cache.lock:  # the write-through thread changes the manager under it
            self.check_slots()

    def check_slots(self) -> None:
        m = self.cache.manager
        level = m._levels[1]
        tier = level.tier
        awake = set(level.slots.values())
        assert len(awake) == len(level.slots)
        d = tier._dormant
        dormant = set(np.flatnonzero(d._asleep).tolist()) if d is not None else set()
        assert not awake & dormant and len(dormant) == tier.dormant_blocks
        assert tier.used_blocks == len(awake) + len(dormant)
        for k in level.slots:  # an indexed key is dormant nowhere
            assert tier.find_dormant([k]) == [-1]


ReopenMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestReopenMachine = ReopenMachine.TestCase


def test_a_chain_spread_over_dormant_nvme_and_a_lazy_lmdb_store(tmp_path) -> None:
    from tiercache.tiers.lmdb import LMDBTier

    keys = [K(i) for i in range(6)]

    def lmdb() -> LMDBTier:
        return LMDBTier(path=str(tmp_path / "l"), block_bytes=BB, capacity_blocks=16, lazy=True)

    # Blocks 0, 1, 4 and 5 on NVMe, 2 and 3 in LMDB, stored by earlier processes.
    t = nvme(tmp_path / "n", 8)
    part = [keys[0], keys[1], keys[4], keys[5]]
    t.write(t.allocate(part), rows(part), part)
    t.close()
    lm = lmdb()
    lm.write(lm.allocate(keys[2:4]), rows(keys[2:4]), keys[2:4])
    lm.close()
    t, lm = nvme(tmp_path / "n", 8), lmdb()
    assert (t.dormant_blocks, lm.used_blocks, lm.open_report["lazy"]) == (4, 0, 1)
    m = OffloadingManager([t, lm], [LRUPolicy(8), LRUPolicy(16)])
    # The lookup runs on through a dormant run, a run the LMDB probe finds, and dormant again.
    assert m.lookup(keys) == 6
    assert [m.where(k) for k in keys] == [[0], [0], [1], [1], [0], [0]]
    spec = m.prepare_load(keys)
    out = torch.empty((6, BB), dtype=torch.uint8)
    for tier_index, tier in enumerate((t, lm)):
        pos = [i for i, ti in enumerate(spec.tiers) if ti == tier_index]
        got = torch.empty((len(pos), BB), dtype=torch.uint8)
        assert tier.read([spec.slots[i] for i in pos], got, [keys[i] for i in pos]) == []
        out[pos] = got
    m.complete_load(keys)
    assert torch.equal(out, rows(keys))
    t.close()
    lm.close()
