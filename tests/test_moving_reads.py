"""A block moving out of a tier stays readable from its source slot until the move completes
or is given up (issue 35), where the facade runs the move: the write-through thread's batch,
whose copies run without the cache's lock, and a put whose store demotes blocks (its plan
runs without the lock). A read pins the source slot; the copy or store that reuses the slot
waits for it. Real tiers: CPU, then NVMe written through, then LMDB whose writes hang (a hung
lower tier); CPU over LMDB; CPU over a real Redis server that is SIGSTOPped."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch

from tests.test_deadlines import HangWrites
from tests.test_manager import K
from tiercache import TierCache
from tiercache.manager import OffloadingManager
from tiercache.policies import LRUPolicy
from tiercache.tiers.cpu import CPUTier

BB = 4096


def _cpu_nvme_lmdb(tmp_path: Path, cpu: int, nvme: int, lmdb: int, **extra: Any) -> dict[str, Any]:
    """A cache config of CPU, NVMe and LMDB tiers of these sizes, both disks written back
    (a block reaches them only by demotion), 4-token blocks."""
    disk = {"write_policy": "write-back"}
    return {
        "block_size": 4,
        **extra,
        "tiers": [
            {"kind": "cpu", "blocks": cpu},
            {
                "kind": "nvme",
                "path": str(tmp_path / "nvme"),
                "blocks": nvme,
                "fsync": "never",
                **disk,
            },
            {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "blocks": lmdb, **disk},
        ],
    }


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BB), dtype=torch.uint8, generator=g)


def hung_lmdb_config(tmp_path: Path) -> dict[str, Any]:
    """CPU (2 blocks), NVMe written through (2), LMDB written back (16): the tiers whose LMDB
    writes the tests hang. No promotion: a get's copy up into the CPU tier would demote a CPU
    block into the hung tier under the cache's lock, which is another matter (it waits out
    the write). Shared with tests/vllm/test_moving_reads.py."""
    return {
        "promote": False,
        "tiers": [
            {"kind": "cpu", "blocks": 2},
            {
                "kind": "nvme",
                "path": str(tmp_path / "nvme"),
                "blocks": 2,
                "fsync": "never",
                "write_policy": "write-through",
            },
            {
                "kind": "lmdb",
                "path": str(tmp_path / "lmdb"),
                "blocks": 16,
                "write_policy": "write-back",
            },
        ],
    }


def _open(tmp_path: Path) -> TierCache:
    return TierCache.open({"block_size": 4, **hung_lmdb_config(tmp_path)}, block_bytes=BB)


def _moving(tmp_path: Path) -> tuple[TierCache, HangWrites, list[bytes], torch.Tensor]:
    """Chain A in the CPU tier and NVMe; then chain B: the CPU tier drops A (NVMe holds it)
    and B's write-through copy into NVMe evicts A there, which moves down into the LMDB
    tier, whose write hangs. A's bytes are intact in its NVMe slot meanwhile (B's copy into
    it comes after the move, in the same batch)."""
    cache = _open(tmp_path)
    hang = HangWrites(cache.tiers[2])
    a, b = cache.hash_tokens(list(range(8))), cache.hash_tokens(list(range(100, 108)))
    data_a = _rows(2, 1)
    cache.put(a, data_a)
    cache.flush()  # A written through into NVMe
    cache.put(b, _rows(2, 2))
    assert hang.entered.wait(10)  # A's demotion into LMDB hangs
    m = cache.manager
    # One copy per batch here (a copy pins its source, at most a share of the CPU tier): B's
    # first copy evicted A's head (NVMe's LRU); A's tail is still there.
    assert m.is_moving(a[0]) and m.where(a[1]) == [1]
    return cache, hang, a, data_a


def test_a_block_moving_into_a_hung_tier_is_served_from_its_source(tmp_path: Path) -> None:
    cache, hang, a, data_a = _moving(tmp_path)
    try:
        assert cache.lookup(a) == 2
        got = cache.get(a)
        assert torch.equal(got, data_a)  # whole, from the NVMe slots it is leaving
        assert cache.stats()["nvme"]["errors"] == 0
    finally:
        hang.release.set()
        cache.close()


def test_the_copy_into_a_leaving_slot_waits_for_its_reader(tmp_path: Path) -> None:
    """The read of a leaving block pins its source slot: the write-through copy that reuses
    the slot (B's) does not write it before the read has finished, even once the move
    ended; then everything lands: A in LMDB, B in NVMe, exact."""
    cache, hang, a, data_a = _moving(tmp_path)
    nvme = cache.tiers[1]
    read, reading, writes = nvme.read, threading.Event(), []
    go = threading.Event()

    def slow_read(slots, dst, keys=None):
        reading.set()
        go.wait(10)  # the reader holds the slot while the move ends
        return read(slots, dst, keys)

    write = nvme.write

    def logged_write(slots, src, keys=None):
        writes.append(time.monotonic())
        return write(slots, src, keys)

    nvme.read, nvme.write = slow_read, logged_write
    out: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: out.append(cache.get(a)))
    try:
        t.start()
        assert reading.wait(10)
        hang.release.set()  # the move lands in LMDB; B's copy into A's slots is next
        time.sleep(0.3)
        assert writes == []  # ... and waits for the reader
        released = time.monotonic()
        go.set()
        t.join(10)
        assert torch.equal(out[0], data_a)
        cache.flush()
        assert writes and min(writes) >= released
        nvme.read = read
        assert torch.equal(cache.get(a), data_a)  # from LMDB now
        assert cache.manager.where(a[0]) == [2]
        st = cache.stats()
        assert st["nvme"]["errors"] == 0 and st["lmdb"]["errors"] == 0
    finally:
        go.set()
        hang.release.set()
        t.join(10)
        cache.close()


# -- the manager's bookkeeping ----------------------------------------------------------------
def _three_tiers() -> OffloadingManager:
    """t0 (2 blocks) over t1 (2, written through) over t2 (8): a write-through copy into t1
    evicts there and moves the victim down into t2."""
    tiers = [
        CPUTier(name=f"t{i}", block_bytes=8, capacity_blocks=c) for i, c in enumerate((2, 2, 8))
    ]
    return OffloadingManager(
        tiers, [LRUPolicy(c) for c in (2, 2, 8)], write_through=[False, True, False]
    )


def _through(m: OffloadingManager, keys: list[bytes]) -> list:
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.keys_to_store)
    return m.plan_write_through(limit=8)


def test_manager_serves_a_leaving_block_until_its_move_completes() -> None:
    m = _three_tiers()
    for mv in _through(m, [K(0), K(1)]):  # K0, K1 into t0, written through into t1
        m.complete_write_through(mv.keys)
    # 1. K2, K3: t0 drops K0, K1 (t1 holds them); their copy into t1 moves K0, K1 to t2.
    demote, copy = _through(m, [K(2), K(3)])
    assert demote.keys == (K(0), K(1)) and demote.dst.tier == 2 and copy.dst.tier == 1
    # 2. Moving: a plain lookup asks again; a leaving one serves them from t1's old slots.
    assert m.lookup([K(0), K(1)]) is None
    assert m.lookup_ready([K(0), K(1)], leaving=True) == (2, False)
    spec = m.prepare_load([K(0), K(1)], leaving=True)
    assert spec.tiers == (1, 1) and spec.slots == demote.src.slots
    # 3. The read pins those slots: the copy into them waits; the move completing does not
    #    unpin them, but no new read is served from there.
    assert m.reading(1, copy.dst.slots)
    m.complete_write_through(demote.keys)
    assert m.reading(1, copy.dst.slots)
    assert m.lookup_ready([K(0)], leaving=True) == (1, False) and m.where(K(0)) == [2]
    # 4. The copy fails: its slots are freed only when the read ends.
    m.complete_write_through(copy.keys, success=False)
    free = m.tiers[1].free_blocks
    m.complete_load([K(0), K(1)])
    assert not m.reading(1, copy.dst.slots) and m.tiers[1].free_blocks == free + 2


def test_a_leaving_block_given_up_is_a_miss_and_other_moves_never_leave() -> None:
    m = _three_tiers()
    for mv in _through(m, [K(0), K(1)]):
        m.complete_write_through(mv.keys)
    demote, _ = _through(m, [K(2), K(3)])
    m.unmove(demote.keys)  # its destination hung past the deadline
    assert m.lookup_ready([K(0)], leaving=True) == (0, False)
    # A store's own demotion (run by a transfer engine, whose store into the slot waits only
    # for the move's read) is never served from its source.
    m2 = OffloadingManager(
        [CPUTier(name=f"t{i}", block_bytes=8, capacity_blocks=2) for i in range(2)],
        [LRUPolicy(2), LRUPolicy(2)],
    )
    out = m2.prepare_store([K(0), K(1)])
    m2.complete_store(out.keys_to_store)
    out = m2.prepare_store([K(2)])
    (mv,) = out.moves
    assert m2.lookup_ready(mv.keys, leaving=True) == (0, True)


# -- a put's own demotions --------------------------------------------------------------------
class FailWrites:
    """Makes a tier's writes block until released, then fail with an I/O error (a disk that
    hung, then gave up)."""

    def __init__(self, tier) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

        def failing_write(slots, blocks, keys=None):
            self.entered.set()
            self.release.wait(30)
            raise OSError(5, "injected: the disk gave up")

        tier.write = failing_write


def _cpu_over_lmdb(tmp_path: Path) -> TierCache:
    """CPU (4 blocks) over LMDB written back (16): its writes are demotions only; no
    promotion."""
    cfg = {
        "block_size": 4,
        "promote": False,
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            {
                "kind": "lmdb",
                "path": str(tmp_path / "lmdb"),
                "blocks": 16,
                "write_policy": "write-back",  # its writes are the put's demotions alone
            },
        ],
    }
    return TierCache.open(cfg, block_bytes=BB)


def _put_in_thread(cache: TierCache, keys: list[bytes], data: torch.Tensor) -> tuple:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(cache.put(keys, data)))
    t.start()
    return t, out


def _chains(cache: TierCache) -> tuple[list[bytes], torch.Tensor, list[bytes], torch.Tensor]:
    """Chain A (4 blocks) fills the CPU tier; chain B (2) will evict A's tail into LMDB."""
    a, b = cache.hash_tokens(list(range(16))), cache.hash_tokens(list(range(100, 108)))
    data_a, data_b = _rows(4, 1), _rows(2, 2)
    assert cache.put(a, data_a) == 4
    return a, data_a, b, data_b


def test_a_put_demoting_into_a_hung_tier_leaves_every_cpu_block_served(tmp_path: Path) -> None:
    """B's store evicts A's tail from the CPU tier; the demotion into LMDB hangs. Meanwhile
    every block the CPU tier holds (A whole, two of its blocks leaving) is served whole, at
    once: the put runs its plan without the cache's lock, and the leaving blocks are read
    from their source slots. Then the move lands and B is stored, exact."""
    cache = _cpu_over_lmdb(tmp_path)
    a, data_a, b, data_b = _chains(cache)
    hang = HangWrites(cache.tiers[1])
    t, out = _put_in_thread(cache, b, data_b)
    m = cache.manager
    try:
        assert hang.entered.wait(10)
        assert m.is_moving(a[2]) and m.is_moving(a[3]) and m.where(a[0]) == [0]
        assert cache.lookup(a) == 4
        assert torch.equal(cache.get(a), data_a)  # whole: A's tail from its CPU slots
        assert cache.lookup(b) == 0  # B is not stored yet: its slots wait for the move
        # Served while the put still hangs (a get waiting for it would see it done).
        assert t.is_alive() and m.is_moving(a[2])
        hang.release.set()
        t.join(10)
        assert out == [2]
        assert m.where(a[2]) == [1] and m.where(b[0]) == [0]
        assert torch.equal(cache.get(a), data_a)  # head from the CPU tier, tail from LMDB
        assert torch.equal(cache.get(b), data_b)
        st = cache.stats()
        assert st["cpu"]["errors"] == 0 and st["lmdb"]["errors"] == 0
    finally:
        hang.release.set()
        t.join(10)
        cache.close()


def test_a_puts_store_into_a_leaving_slot_waits_for_its_reader(tmp_path: Path) -> None:
    """A read of a leaving block pins its source slot: B's store into that slot waits for
    the read, even once the move has landed, so the reader gets A's bytes whole and never a
    half-written B."""
    cache = _cpu_over_lmdb(tmp_path)
    a, data_a, b, data_b = _chains(cache)
    hang = HangWrites(cache.tiers[1])
    cpu = cache.tiers[0]
    read, write = cpu.read, cpu.write
    reading, go, writes = threading.Event(), threading.Event(), []

    def slow_read(slots, dst, keys=None):
        reading.set()
        go.wait(10)  # the reader holds the slots while the move ends
        return read(slots, dst, keys)

    def logged_write(slots, src, keys=None):
        writes.append(time.monotonic())
        return write(slots, src, keys)

    t, out = _put_in_thread(cache, b, data_b)
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(cache.get(a)))
    try:
        assert hang.entered.wait(10)
        cpu.read, cpu.write = slow_read, logged_write
        reader.start()
        assert reading.wait(10)  # A's four slots pinned, two of them leaving
        hang.release.set()  # the move lands in LMDB; B's store into A's tail slots is next
        time.sleep(0.3)
        assert writes == [] and t.is_alive()  # ... and waits for the reader
        released = time.monotonic()
        go.set()
        reader.join(10)
        assert torch.equal(got[0], data_a)
        t.join(10)
        assert out == [2] and writes and min(writes) >= released
        cpu.read = read
        assert torch.equal(cache.get(b), data_b)
        assert torch.equal(cache.get(a), data_a)  # the tail from LMDB now
        assert cache.manager.where(a[3]) == [1]
    finally:
        go.set()
        hang.release.set()
        reader.join(10) if reader.is_alive() else None
        t.join(10)
        cache.close()


def test_a_put_whose_demotion_fails_drops_the_block_and_serves_nothing_half_written(
    tmp_path: Path,
) -> None:
    """The demotion hangs, then fails: reads while it hung got A whole; once it failed, A's
    tail is a miss (dropped, as any failed move's block), counted, and its old slots hold B,
    served under B's keys only."""
    cache = _cpu_over_lmdb(tmp_path)
    a, data_a, b, data_b = _chains(cache)
    fail = FailWrites(cache.tiers[1])
    t, out = _put_in_thread(cache, b, data_b)
    try:
        assert fail.entered.wait(10)
        assert torch.equal(cache.get(a), data_a) and t.is_alive()
        fail.release.set()
        t.join(10)
        assert out == [2]
        assert cache.lookup(a) == 2 and not cache.manager.is_moving(a[2])
        assert torch.equal(cache.get(a), data_a[:2])
        assert torch.equal(cache.get(b), data_b)
        assert cache.stats()["lmdb"]["errors"] == 1
    finally:
        fail.release.set()
        t.join(10)
        cache.close()


def test_a_stopped_redis_server_leaves_every_cpu_block_served(tmp_path: Path) -> None:
    """Issue 35's case: CPU over a real Redis server that is SIGSTOPped. B's store demotes
    A's tail into Redis, whose write waits for the server; every block the CPU tier holds is
    served whole meanwhile. The server resumes: the move lands, and A and B read back exact."""
    from tests.test_tier_redis import RedisServer, require_redis

    require_redis()
    srv = RedisServer(tmp_path / "r")
    cfg = {
        "block_size": 4,
        "promote": False,
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            {
                "kind": "redis",
                "url": srv.url,
                "blocks": 16,
                "timeout": 20.0,
                "write_policy": "write-back",
            },
        ],
    }
    cache = TierCache.open(cfg, block_bytes=BB)
    t = None
    try:
        a, data_a, b, data_b = _chains(cache)
        redis_tier = cache.tiers[1]
        entered, write = threading.Event(), redis_tier.write

        def watched_write(slots, blocks, keys=None):
            entered.set()
            return write(slots, blocks, keys)

        redis_tier.write = watched_write
        srv.pause()
        t, out = _put_in_thread(cache, b, data_b)
        assert entered.wait(10)
        m = cache.manager
        assert m.is_moving(a[2]) and m.is_moving(a[3])
        assert cache.lookup(a) == 4 and torch.equal(cache.get(a), data_a)
        assert t.is_alive() and m.is_moving(a[2])  # the server is still stopped
        srv.resume()
        t.join(20)
        assert out == [2] and m.where(a[2]) == [1]
        assert torch.equal(cache.get(a), data_a) and torch.equal(cache.get(b), data_b)
        assert cache.stats()["redis"]["errors"] == 0
    finally:
        srv.resume()
        if t is not None:
            t.join(20)
        cache.close()
        srv.kill()


def test_manager_a_stores_own_demotion_leaves_when_asked() -> None:
    """prepare_store(leaving=True): the blocks its moves demote are served from their source
    slots, which stay busy (`reading`) while the move runs, and while a read pins them."""
    m = OffloadingManager(
        [CPUTier(name=f"t{i}", block_bytes=8, capacity_blocks=2) for i in range(2)],
        [LRUPolicy(2), LRUPolicy(2)],
    )
    out = m.prepare_store([K(0), K(1)])
    m.complete_store(out.keys_to_store)
    out = m.prepare_store([K(2)], leaving=True)
    (mv,) = out.moves
    (k,) = mv.keys
    # 1. Moving: served from its source slot, which is the slot K2 is stored into.
    assert m.lookup([k]) is None and m.lookup_ready([k], leaving=True) == (1, False)
    assert out.store_spec.slots == mv.src.slots and m.reading(0, mv.src.slots)
    spec = m.prepare_load([k], leaving=True)
    assert spec.tiers == (0,) and spec.slots == mv.src.slots
    # 2. The move lands: served from t1 now; the source stays busy while the read pins it.
    m.complete_store(mv.keys)
    assert m.where(k) == [1] and m.reading(0, mv.src.slots)
    m.complete_load([k])
    assert not m.reading(0, mv.src.slots)
    # 3. Another leaving move, given up: a miss from then on, its source no longer busy.
    m.complete_store(out.keys_to_store)
    out = m.prepare_store([K(3)], leaving=True)
    (mv,) = out.moves
    m.unmove(mv.keys)
    assert m.lookup_ready(mv.keys, leaving=True) == (0, False)
    assert not m.reading(0, mv.src.slots)


def test_concurrent_puts_and_gets_never_serve_a_half_written_block(tmp_path: Path) -> None:
    """Puts that demote (CPU -> NVMe -> LMDB, small tiers, slowed disk writes) beside gets:
    every block a get returns is its key's own bytes, whatever moves or reuses its slot
    meanwhile (leaving blocks read from their source slots, stores waiting for them)."""
    cfg = _cpu_nvme_lmdb(tmp_path, 4, 6, 64, promote=False)
    cache = TierCache.open(cfg, block_bytes=BB)
    for tier in cache.tiers[1:]:  # slow disks: moves stay in flight while others read
        write = tier.write

        def slow_write(slots, blocks, keys=None, write=write):
            time.sleep(0.002)
            return write(slots, blocks, keys)

        tier.write = slow_write
    chains = [cache.hash_tokens(list(range(i * 100, i * 100 + 4 * (1 + i % 3)))) for i in range(12)]

    def rows(keys: list[bytes]) -> torch.Tensor:  # each block is its key, repeated
        return torch.frombuffer(
            bytearray(b"".join(k * (BB // 16) for k in keys)), dtype=torch.uint8
        ).view(len(keys), BB)

    errors: list[str] = []
    served = [0]

    def putter(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(60):
            c = chains[int(torch.randint(0, len(chains), (1,), generator=g))]
            cache.put(c, rows(c))

    def getter(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(150):
            c = chains[int(torch.randint(0, len(chains), (1,), generator=g))]
            got = cache.get(c)
            served[0] += got.shape[0]
            if got.shape[0] and not torch.equal(got, rows(c[: got.shape[0]])):
                errors.append(f"chain {chains.index(c)}: wrong bytes in {got.shape[0]} blocks")

    def run(body, seed: int) -> None:  # a thread's exception fails the test
        try:
            body(seed)
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(putter, s)) for s in (1, 2)]
    threads += [threading.Thread(target=run, args=(getter, s)) for s in (3, 4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert errors == [] and served[0] > 0
        st = cache.stats()
        assert all(st[m]["errors"] == 0 for m in ("cpu", "nvme", "lmdb")), st
        assert st["nvme"]["demoted_in"] > 0 and st["lmdb"]["demoted_in"] > 0
    finally:
        cache.close()


def test_close_leaves_the_tier_a_hung_put_writes_as_it_is(tmp_path: Path) -> None:
    """close() waits for a put whose demotion hangs only up to `store_timeout`: then the
    hung tier is suspended and neither flushed nor closed under the put's write; the put
    still completes once the disk comes back."""
    cfg = {
        "block_size": 4,
        "promote": False,
        "deadlines": {"store_timeout": 0.2},
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            {
                "kind": "lmdb",
                "path": str(tmp_path / "lmdb"),
                "blocks": 16,
                "write_policy": "write-back",
            },
        ],
    }
    cache = TierCache.open(cfg, block_bytes=BB)
    _, _, b, data_b = _chains(cache)
    lmdb = cache.tiers[1]
    hang = HangWrites(lmdb)
    closed: list[str] = []
    close = lmdb.close
    lmdb.close = lambda: closed.append("closed")
    t, out = _put_in_thread(cache, b, data_b)
    closer = threading.Thread(target=cache.close)
    try:
        assert hang.entered.wait(10)
        closer.start()
        closer.join(10)
        assert not closer.is_alive() and t.is_alive()  # closed while the put still hangs
        assert closed == [] and cache.manager.suspended()[1] > 0
        hang.release.set()
        t.join(10)
        assert out == [2]
    finally:
        hang.release.set()
        t.join(10)
        closer.join(10) if closer.is_alive() else None
        close()


def test_a_gets_promotion_demoting_into_a_hung_tier_leaves_the_rest_served(
    tmp_path: Path,
) -> None:
    """CPU (2) over NVMe (4) over LMDB (16) whose writes hang, with promotion: a get of a
    chain held on NVMe promotes it, which demotes the CPU tier's chain into NVMe and NVMe's
    oldest into LMDB (hung). That get runs its promotion without the cache's lock, so both
    demoted chains are served whole from their source slots meanwhile; then all land."""
    cfg = _cpu_nvme_lmdb(tmp_path, 2, 4, 16)
    cache = TierCache.open(cfg, block_bytes=BB)
    a, b, c = (cache.hash_tokens(list(range(i, i + 8))) for i in (0, 100, 200))
    data = {0: _rows(2, 1), 1: _rows(2, 2), 2: _rows(2, 3)}
    for i, keys in enumerate((a, b, c)):  # the CPU tier holds C; NVMe holds A and B
        cache.put(keys, data[i])
    m = cache.manager
    assert m.where(c[0]) == [0] and m.where(a[0]) == [1] and m.where(b[0]) == [1]
    hang = HangWrites(cache.tiers[2])
    got_a: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got_a.append(cache.get(a)))
    try:
        t.start()
        assert hang.entered.wait(10)  # B's demotion into LMDB hangs; C's into NVMe waits
        assert m.is_moving(b[0]) and m.is_moving(c[0])
        assert torch.equal(cache.get(b), data[1])  # from its NVMe slots
        assert torch.equal(cache.get(c), data[2])  # from its CPU slots
        assert t.is_alive() and m.is_moving(b[0])  # served beside the hung promotion
        hang.release.set()
        t.join(10)
        assert torch.equal(got_a[0], data[0])
        assert m.where(a[0]) == [0, 1] and m.where(c[0]) == [1] and m.where(b[0]) == [2]
        for i, keys in enumerate((a, b, c)):
            assert torch.equal(cache.get(keys), data[i])
        assert all(cache.stats()[t]["errors"] == 0 for t in ("cpu", "nvme", "lmdb"))
    finally:
        hang.release.set()
        t.join(10)
        cache.close()
