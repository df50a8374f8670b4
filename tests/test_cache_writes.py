"""Nothing dropped while a lower tier has room (issue 19), through the public facade, on real
files and a real LMDB environment: write-around for chains longer than the first tier, and
write-through, which keeps what volatile tiers hold safe from a SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tiercache.plan_runner as plan_runner
import tiercache.write_through as write_through
from tiercache import ConfigError, TierCache
from tiercache.workload import block_bytes_for

N = 4096


def three_tiers(tmp: Path, **write: str) -> dict:
    """cpu 4 blocks, nvme 64, lmdb 128, as in the issue's vLLM run; `write` sets the
    write_policy of "nvme" and "lmdb"."""
    tiers: list[dict] = [
        {"kind": "cpu", "blocks": 4},
        {"kind": "nvme", "blocks": 64, "path": str(tmp / "nvme"), "direct": False},
        {"kind": "lmdb", "blocks": 128, "path": str(tmp / "lmdb")},
    ]
    for t in tiers[1:]:
        if t["kind"] in write:
            t["write_policy"] = write[t["kind"]]
    return {"block_size": 4, "namespace": "writes/bf16/tp1/0", "tiers": tiers}


def test_a_chain_ten_times_the_first_tier_is_found_whole(tmp_path: Path) -> None:
    with TierCache.open(three_tiers(tmp_path), block_bytes=N) as cache:
        keys = cache.hash_tokens(list(range(4 * 40)))  # 40 blocks, the first tier holds 4
        blocks = block_bytes_for(keys, N)
        assert cache.put(keys, blocks) == 40
        assert cache.lookup(keys) == 40
        assert torch.equal(cache.get(keys), blocks)
        cache.flush()
        s = cache.stats()
        # The head in the first tier, the other 36 written around into nvme, and the head
        # copied there too by write-through: each block stored once per tier, none dropped.
        assert (s["cpu"]["stored"], s["nvme"]["stored"], s["nvme"]["written_through"]) == (4, 40, 4)
        assert s["lmdb"]["stored"] == 0 and s["cpu"]["dropped"] == 0
    # After a restart the whole chain is still there (persistent tiers).
    with TierCache.open(three_tiers(tmp_path), block_bytes=N) as cache:
        assert cache.lookup(keys) == 40
        assert torch.equal(cache.get(keys), blocks)


def test_chains_longer_than_every_tier_but_the_last(tmp_path: Path) -> None:
    with TierCache.open(three_tiers(tmp_path), block_bytes=N) as cache:
        keys = cache.hash_tokens(list(range(4 * 100)))  # 100 blocks: cpu 4 + nvme 64 + lmdb
        blocks = block_bytes_for(keys, N)
        assert cache.put(keys, blocks) == 100
        assert cache.lookup(keys) == 100
        assert torch.equal(cache.get(keys), blocks)


def test_write_back_keeps_lower_tiers_for_evictions(tmp_path: Path) -> None:
    cfg = three_tiers(tmp_path, nvme="write-back")
    with TierCache.open(cfg, block_bytes=N) as cache:
        keys = cache.hash_tokens(list(range(4 * 3)))
        cache.put(keys, block_bytes_for(keys, N))
        cache.flush()
        s = cache.stats()
        assert (s["cpu"]["used_blocks"], s["nvme"]["used_blocks"]) == (3, 0)
        assert s["nvme"]["written_through"] == 0


def test_write_through_is_the_default_below_a_volatile_tier(tmp_path: Path) -> None:
    with TierCache.open(three_tiers(tmp_path), block_bytes=N) as cache:
        assert cache.config.write_through == [False, True, False]
        keys = cache.hash_tokens(list(range(4 * 3)))
        blocks = block_bytes_for(keys, N)
        cache.put(keys, blocks)
        cache.flush()  # waits for the copier
        s = cache.stats()
        assert (s["cpu"]["used_blocks"], s["nvme"]["used_blocks"]) == (3, 3)
        assert (s["nvme"]["written_through"], s["nvme"]["through_queued"]) == (3, 0)
        assert all(cache.manager.where(k) == [0, 1] for k in keys)
        # Evicting them from the first tier demotes nothing: nvme holds them already.
        more = cache.hash_tokens(list(range(1000, 1000 + 4 * 4)))
        cache.put(more, block_bytes_for(more, N))
        cache.flush()
        assert cache.stats()["nvme"]["demoted_in"] == 0
        assert torch.equal(cache.get(keys), blocks)


def test_write_through_from_runs_and_scattered_cpu_slots(tmp_path: Path) -> None:
    # Copies out of the CPU tier hand its rows to NVMe in place when the source slots form a
    # few runs, and go through staging when they are scattered: both reach the disk exactly.
    config = {
        "block_size": 4,
        "namespace": "writes/bf16/tp1/0",
        "tiers": [
            {"kind": "cpu", "blocks": 32, "policy": "lru"},
            {"kind": "nvme", "blocks": 64, "path": str(tmp_path / "nvme"), "direct": False},
        ],
    }
    chains = [list(range(i, i + 4 * n)) for i, n in ((0, 24), (1000, 8), (2000, 12))]
    with TierCache.open(config, block_bytes=N) as cache:
        cpu = cache.tiers[0]
        assert plan_runner.host_runs(cpu, list(range(16))) == [(0, 16)]
        assert plan_runner.host_runs(cpu, [*range(8), *range(20, 28)]) == [(0, 8), (8, 16)]
        assert plan_runner.host_runs(cpu, list(range(0, 32, 2))) is None  # scattered
        assert plan_runner.host_runs(cache.tiers[1], list(range(16))) is None  # not memory
        a, b, c = (cache.hash_tokens(t) for t in chains)
        cache.put(a, block_bytes_for(a, N))  # slots 0..23: one run
        cache.flush()
        cache.get(a[1::2])  # a's odd blocks are used: its even ones are now the oldest
        cache.put(b, block_bytes_for(b, N))  # slots 24..31: the CPU tier is full
        cache.put(c, block_bytes_for(c, N))  # into the slots of a's even blocks: scattered
        cache.flush()
        s = cache.stats()
        assert s["nvme"]["written_through"] == 44 and s["nvme"]["errors"] == 0
    with TierCache.open(config, block_bytes=N) as cache:  # restarted: only NVMe has them
        for keys in (a, b, c):
            assert cache.lookup(keys) == len(keys)
            assert torch.equal(cache.get(keys), block_bytes_for(keys, N))


def test_an_adapter_wakes_the_write_through_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The vLLM connectors drive the manager themselves (no `put` to wake the copier): after
    # `complete_store` they call `wake_write_through`, so a block is copied down at once
    # instead of at the thread's next poll (what a server killed right after a response
    # loses). With the poll made a minute long, only the wake can start the copies.
    monkeypatch.setattr(write_through, "THROUGH_POLL_S", 60.0)
    with TierCache.open(three_tiers(tmp_path), block_bytes=N) as cache:
        keys = cache.hash_tokens(list(range(4 * 3)))
        with cache.lock:  # as an adapter does: plan, transfer (skipped here), complete
            plan = cache.manager.prepare_store(keys)
            assert plan is not None and len(plan.stored_keys) == 3
            cache.manager.complete_store(plan.stored_keys, success=True)
        time.sleep(0.5)
        assert cache.stats()["nvme"]["written_through"] == 0  # queued, the thread asleep
        cache.wake_write_through()
        deadline = time.monotonic() + 30
        while cache.stats()["nvme"]["written_through"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cache.stats()["nvme"]["written_through"] == 3


def test_write_policy_is_validated() -> None:
    base = {"tiers": [{"kind": "cpu", "blocks": 4}, {"kind": "cpu", "name": "b", "blocks": 4}]}
    bad = {**base, "tiers": [base["tiers"][0], {**base["tiers"][1], "write_policy": "often"}]}
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.write_policy: expected one of"):
        TierCache.open(bad, block_bytes=N)
    first = {"tiers": [{"kind": "cpu", "blocks": 4, "write_policy": "write-through"}]}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.write_policy: the first tier"):
        TierCache.open(first, block_bytes=N)
    with pytest.raises(ConfigError, match="write_through_queue"):
        TierCache.open({**base, "write_through_queue": 0}, block_bytes=N)


def test_the_write_through_queue_is_bounded_and_drops_are_counted(tmp_path: Path) -> None:
    cfg = {**three_tiers(tmp_path), "write_through_queue": 2}
    cfg["tiers"][0]["blocks"] = 64
    with TierCache.open(cfg, block_bytes=N) as cache:
        cache._through.io.acquire()  # hold the copier, as a slow disk would
        try:
            keys = cache.hash_tokens(list(range(4 * 10)))
            assert cache.put(keys, block_bytes_for(keys, N)) == 10  # never waits
            s = cache.stats()["nvme"]
            assert s["through_queued"] <= 2 and s["through_dropped"] >= 8
        finally:
            cache._through.io.release()
        cache.flush()
        s = cache.stats()["nvme"]
        assert s["written_through"] + s["through_dropped"] == 10


_CRASH_CHILD = """
import json, os, signal, sys, time
from tiercache import TierCache
from tiercache.workload import block_bytes_for
cache = TierCache.open(json.loads(sys.argv[1]), block_bytes=4096)
chains = []
for c in range(6):
    keys = cache.hash_tokens(list(range(c * 1000, c * 1000 + 4 * 3)))
    cache.put(keys, block_bytes_for(keys, 4096))
    chains.append([k.hex() for k in keys])
# Wait (30 s at most) until the copier has written through the blocks the parent expects:
# its last batch is complete, not just taken off the queue.
expected, deadline = int(sys.argv[2]), time.monotonic() + 30
def through():
    s = cache.stats()
    return sum(s[m]["written_through"] for m in s)
while through() < expected and time.monotonic() < deadline:
    time.sleep(0.01)
s = cache.stats()
print(json.dumps({"chains": chains, "through": {m: s[m]["written_through"] for m in s}}))
sys.stdout.flush()
os.kill(os.getpid(), signal.SIGKILL)  # no close, no exit hook
"""


def crash_child(cfg: dict, through: int) -> dict:
    """Run _CRASH_CHILD on `cfg`; what it printed before it SIGKILLed itself, once
    `through` blocks were written through (or after 30 s)."""
    run = subprocess.run(
        [sys.executable, "-c", _CRASH_CHILD, json.dumps(cfg), str(through)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    return json.loads(run.stdout)


@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_write_through_survives_sigkill(tmp_path: Path, kind: str) -> None:
    tiers = [{"kind": "cpu", "blocks": 64}]  # everything fits the volatile tier
    tiers.append({"kind": kind, "blocks": 64, "path": str(tmp_path / kind)})
    if kind == "nvme":
        tiers[-1]["direct"] = False
    cfg = {"block_size": 4, "namespace": "crash/bf16/tp1/0", "tiers": tiers}
    out = crash_child(cfg, through=18)
    assert out["through"][kind] == 18  # 6 chains of 3 blocks, all copied before the kill
    with TierCache.open(cfg, block_bytes=N) as cache:
        for chain in out["chains"]:
            keys = [bytes.fromhex(h) for h in chain]
            assert cache.lookup(keys) == 3
            assert torch.equal(cache.get(keys), block_bytes_for(keys, N))
    # The same without write-through loses what only the volatile tier held.
    cfg["tiers"][1]["write_policy"] = "write-back"
    cfg["tiers"][1]["path"] = str(tmp_path / f"{kind}-back")
    out = crash_child(cfg, through=0)  # nothing is copied: no wait
    assert out["through"][kind] == 0
    with TierCache.open(cfg, block_bytes=N) as cache:
        keys = [bytes.fromhex(h) for h in out["chains"][0]]
        assert cache.lookup(keys) == 0
    assert os.path.isdir(tmp_path / kind)


# -- admission on reuse (issue 16) -----------------------------------------------------------
def two_tiers(tmp: Path, **nvme: str) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    tiers = [
        {"kind": "cpu", "blocks": 8},
        {"kind": "nvme", "blocks": 64, "path": str(tmp / "nvme"), "direct": False, **nvme},
    ]
    return {"block_size": 4, "namespace": "admit/bf16/tp1/0", "tiers": tiers}


def scan(cache: TierCache, chains: list[list[bytes]]) -> int:
    """get, then put of the misses, for each chain; blocks served."""
    hits = 0
    for keys in chains:
        n = len(cache.get(keys))
        if n < len(keys):
            cache.put(keys[n:], block_bytes_for(keys[n:], N))
        hits += n
    cache.flush()
    return hits


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_admission_on_reuse_keeps_a_scan_out_of_the_lower_tier(tmp_path: Path, policy: str) -> None:
    chains = [[bytes([c, j]) * 8 for j in range(4)] for c in range(20)]  # 80 blocks, no reuse
    with TierCache.open(two_tiers(tmp_path / "all", write_policy=policy), block_bytes=N) as c:
        scan(c, chains)
        written_all = c.stats()["nvme"]["stored"]
    cfg = two_tiers(tmp_path / "reuse", write_policy=policy, admit="on-reuse")
    with TierCache.open(cfg, block_bytes=N) as c:
        scan(c, chains)
        s = c.stats()["nvme"]
        assert written_all >= 72  # every block evicted (or copied) from the 8-block cpu tier
        assert s["stored"] == 0 and s["not_admitted"] >= 72  # a scan writes nothing below


def test_admission_on_reuse_admits_what_comes_back(tmp_path: Path) -> None:
    # 16 hot blocks and 40 cold ones: the sightings of the last 64 keys (the nvme tier's
    # capacity) are remembered, so the hot ones are still known when they come back.
    hot = [[bytes([100 + c, j]) * 8 for j in range(4)] for c in range(4)]
    cold = [[bytes([c, j]) * 8 for j in range(4)] for c in range(10)]
    cfg = two_tiers(tmp_path, write_policy="write-back", admit="on-reuse")
    with TierCache.open(cfg, block_bytes=N) as c:
        scan(c, hot)  # first sighting: stored in cpu, evicted by the next ones, not admitted
        scan(c, cold)
        assert c.stats()["nvme"]["stored"] == 0
        assert scan(c, hot) == 0  # lost (not admitted); stored again: a second sighting
        scan(c, cold)  # evicts the hot chains again: now they are admitted below
        assert scan(c, hot) == 16  # served from nvme
        s = c.stats()["nvme"]
        assert s["hits"] >= 16 and s["stored"] >= 16


def test_admission_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.admit: the first tier"):
        TierCache.open(
            {"tiers": [{"kind": "cpu", "blocks": 4, "admit": "on-reuse"}]}, block_bytes=N
        )
    bad = {
        "tiers": [
            {"kind": "cpu", "blocks": 4},
            {"kind": "cpu", "name": "b", "blocks": 4, "admit": "sometimes"},
        ]
    }
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.admit: expected one of"):
        TierCache.open(bad, block_bytes=N)
