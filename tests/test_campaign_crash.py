"""Crash campaign: a child process stores blocks through the NVMe and LMDB tiers with
fsync/sync = "always" and is SIGKILLed at seeded random points; after every kill a fresh
process reopens the store. Every acknowledged block (not freed since) reads back
byte-identical, nothing is served with other bytes than were written for its key, and every
block the store recovered reads back verified (the store is clean; through
`tiercache verify` too, once that command exists).

Bounded here (TIERCACHE_CRASH_ITERS, default 8 kills per tier); `-m stress` runs 150 per tier.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from tests.campaign_children import check_store, crash_writer
from tests.campaign_support import cli_verify, report, run_child, scale, start_child

# Blocks of 48 KiB + 100 bytes (NVMe slots are 52 KiB: not a multiple of the payload) and of
# 32 KiB in LMDB (overflow pages); capacities small enough that every run evicts.
SETUPS = {
    "nvme": dict(bb=48 * 1024 + 100, cap=24, opts={"fsync": "always"}),
    "lmdb": dict(bb=32 * 1024, cap=24, opts={"sync": "always", "compression": "zstd"}),
}


def _log_lines(path: Path) -> list[tuple[str, list[int]]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():  # a torn last line has no newline: dropped
        tag, *rest = line.split(" ")
        out.append((tag, [int(x) for x in rest if x]))
    return out


def _acks(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\nA ")  # the first line is always "O"
    except FileNotFoundError:
        return 0


def crash_campaign(
    kind: str, tmp_path: Path, iterations: int, seed: int, verify_every: int
) -> dict:
    setup = SETUPS[kind]
    bb, cap, opts = setup["bb"], setup["cap"], setup["opts"]
    store = tmp_path / kind
    rnd = random.Random(seed)
    required: set[int] = set()  # acknowledged and not freed since: must survive any kill
    figures = dict(kills=0, killed_mid_write=0, acked=0, checked_reads=0, blocks_lost=0)
    verified = 0
    for it in range(iterations):
        log = tmp_path / f"log-{it}"
        child = start_child(
            crash_writer, kind, str(store), bb, cap, str(log), seed * 7919 + it, it * 1000, opts
        )
        # Kill after a seeded number of acknowledgements plus a seeded delay (0 to ~4 ms, so
        # kills land before, inside and after writes, syncs and journal appends).
        target = rnd.randint(0, 8)
        deadline = time.monotonic() + 60
        while _acks(log) < target and child.is_alive():
            assert time.monotonic() < deadline, f"writer made no progress in iteration {it}"
            time.sleep(0.0005)
        time.sleep(rnd.choice([0.0, rnd.uniform(0, 0.004)]))
        assert child.is_alive(), f"the writer of iteration {it} ended by itself"
        child.kill()
        figures["kills"] += 1
        lines = _log_lines(log)
        if lines and lines[-1][0] == "W":
            figures["killed_mid_write"] += 1
        for tag, ids in lines:
            if tag == "F":
                required.difference_update(ids)
            elif tag == "A":
                required.update(ids)
                figures["acked"] += len(ids)
        # `tiercache verify` on the store as the kill left it (every `verify_every` kills and
        # after the last: a CLI run costs ~1.5 s here).
        if (it + 1) % verify_every == 0 or it == iterations - 1:
            v = cli_verify(store)
            if v is not None:
                assert v["returncode"] == 0 and v["report"]["ok"], f"iteration {it}: {v}"
                verified += 1
        # A fresh process reopens the store and reads everything it recovered.
        got = run_child(check_store, kind, str(store), bb, cap, opts)
        assert got["wrong"] == [], f"iteration {it}: served other bytes for {got['wrong']}"
        assert got["failed"] == [], f"iteration {it}: recovered blocks failed {got['failed']}"
        lost = required - set(got["good"])
        figures["blocks_lost"] += len(lost)
        assert not lost, f"iteration {it}: acknowledged blocks {sorted(lost)} are gone"
        figures["checked_reads"] += len(got["good"])
        log.unlink(missing_ok=True)
    return report(
        "crash",
        tier=kind,
        iterations=iterations,
        seed=seed,
        cli_verified=verified,
        **figures,
    )


@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_crash_campaign(kind: str, tmp_path) -> None:
    figures = crash_campaign(kind, tmp_path, scale("crash_iters", 8), seed=1, verify_every=1000)
    assert figures["blocks_lost"] == 0 and figures["acked"] > 0


@pytest.mark.stress
@pytest.mark.parametrize("kind", ["nvme", "lmdb"])
def test_crash_campaign_long(kind: str, tmp_path) -> None:
    figures = crash_campaign(kind, tmp_path, scale("crash_iters", 150), seed=2026, verify_every=10)
    assert figures["blocks_lost"] == 0 and figures["killed_mid_write"] > 0
