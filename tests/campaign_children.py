"""What the campaigns' child processes run (forked from the campaign forkserver, see
`tests.campaign_support.run_child`); no tests here. Each function returns plain data."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.campaign_support import blocks, gets, key, key_id, open_tier, payload, read_all
from tests.ledger import LogWriter


# -- crash -----------------------------------------------------------------------------------
def crash_writer(
    kind: str, path: str, bb: int, cap: int, log_path: str, seed: int, first_id: int, opts: dict
) -> str:
    """Store fresh blocks in batches of 1-4 until SIGKILLed, evicting the oldest when full.

    The log (one os.write per line, so a SIGKILL never loses a line already written):
    "F ids" before a free, "W ids" before a write, "A ids" once the write returned (with
    fsync/sync "always": acknowledged as durable)."""
    rnd = random.Random(seed)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def log(tag: str, ids: list[int]) -> None:
        os.write(fd, f"{tag} {' '.join(map(str, ids))}\n".encode())

    t = open_tier(kind, path, bb, cap, **opts)
    fifo = [(key_id(k), s) for k, s in t.recover()]  # oldest first
    log("O", [len(fifo)])
    nxt = first_id
    for _ in range(100_000):
        n = rnd.randint(1, 4)
        ids = list(range(nxt, nxt + n))
        nxt += n
        while t.free_blocks < n:
            victim, slot = fifo.pop(0)
            log("F", [victim])
            t.free([slot])
        ks = [key(i) for i in ids]
        slots = t.allocate(ks)
        data = blocks(ids, bb)
        log("W", ids)
        t.write(slots, data, ks)
        log("A", ids)
        fifo += list(zip(ids, slots, strict=True))
    t.close()
    return "finished without being killed"


def check_store(kind: str, path: str, bb: int, cap: int, opts: dict) -> dict[str, Any]:
    """Reopen a store in this fresh process and read everything it recovered."""
    t = open_tier(kind, path, bb, cap, **opts)
    try:
        out: dict[str, Any] = read_all(t)
        out["open_report"] = dict(getattr(t, "open_report", {}))
        out["used"] = t.used_blocks
    finally:
        t.close()
    return out


# -- corruption ------------------------------------------------------------------------------
def probe_cache(config: dict, bb: int, ids: list[int], extra_ids: list[int]) -> dict[str, Any]:
    """Open a TierCache on a (damaged) store; get every block alone; then store and read back
    `extra_ids` (the cache keeps serving). A refused open comes back as `refused`."""
    from tiercache import TierCache
    from tiercache.errors import TierCacheError

    try:
        cache = TierCache.open(config, block_bytes=bb)
    except (TierCacheError, ValueError, OSError) as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    try:
        tier = cache.tiers[-1]
        report = dict(getattr(tier, "open_report", {}))
        hit, miss, wrong = gets(cache, ids)
        errors = cache.stats()[tier.medium]["errors"]
        # A lazy LMDB open scans nothing: lookups find and drop malformed entries instead.
        report["blocks_dropped"] = report.get("blocks_dropped", 0) + getattr(
            tier, "stats", dict
        )().get("malformed_dropped", 0)
        # Still serving: new blocks go in and come back exact.
        ks = [key(i) for i in extra_ids]
        cache.put(ks, blocks(extra_ids, bb))
        back = cache.get(ks)
        serving = len(back) == len(ks) and torch.equal(back, blocks(extra_ids, bb))
    finally:
        cache.close()
    return {
        "hit": hit,
        "miss": miss,
        "wrong": wrong,
        "errors": errors,
        "open_report": report,
        "serving": serving,
    }


# -- concurrency -----------------------------------------------------------------------------
def lmdb_reader(path: str, bb: int, cap: int, ids: int, seconds: float, seed: int) -> dict:
    """Read random keys of a store another process writes; every hit must be exact."""
    t = open_tier("lmdb", path, bb, cap, compression="zstd")
    rnd = random.Random(seed)
    hits = misses = wrong = 0
    out = torch.empty((4, bb), dtype=torch.uint8)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            pick = rnd.sample(range(ids), 4)
            failed = set(t.read([0, 1, 2, 3], out, [key(i) for i in pick]))
            for j, i in enumerate(pick):
                if j in failed:
                    misses += 1
                elif np.array_equal(out[j].numpy(), payload(i, bb)):
                    hits += 1
                else:
                    wrong += 1
    finally:
        t.close()
    return {"hits": hits, "misses": misses, "wrong": wrong}


def lmdb_writer(
    path: str,
    bb: int,
    cap: int,
    ids: int,
    seconds: float,
    seed: int,
    turn_file: str | None,
    log: str,
) -> dict:
    """Cycle `ids` keys through a `cap`-block LMDB tier for `seconds`. With `turn_file`, take
    turns with other writers: hold an exclusive flock on it for one session (open, a few
    batches, close), then let the others have it. A store that raises OSError gives its
    slots back, as TierCache does with a failed store, and is counted in `failures`; one
    that failed for another reason than a full map is listed in `other_failures`.

    Every write that returned and every free goes to the ledger log `log` (`tests.ledger`),
    inside the writer's turn: the writers' lines are in the store's order."""
    rnd = random.Random(seed)
    ledger = LogWriter(log)
    deadline = time.monotonic() + seconds
    batches = sessions = failures = 0
    other_failures: list[str] = []
    while time.monotonic() < deadline:
        lock_fd = -1
        if turn_file is not None:
            lock_fd = os.open(turn_file, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            t = open_tier("lmdb", path, bb, cap, compression="zstd")
            try:
                held = {key_id(k): s for k, s in t.recover()}
                order = list(held)
                for _ in range(rnd.randint(3, 12) if turn_file else 1_000_000):
                    if time.monotonic() >= deadline:
                        break
                    want = [i for i in rnd.sample(range(ids), 4) if i not in held]
                    if not want:
                        continue
                    while t.free_blocks < len(want):
                        gone = order.pop(0)
                        t.free([held.pop(gone)])
                        ledger.call(events=[("lmdb", True, [gone])])
                    ks = [key(i) for i in want]
                    slots = t.allocate(ks)
                    try:
                        t.write(slots, blocks(want, bb), ks)
                    except OSError as exc:  # a failed store, as TierCache does: slots back
                        t.free(slots)
                        failures += 1
                        if exc.errno != errno.ENOSPC or "map full" not in str(exc):
                            other_failures.append(str(exc))
                        continue
                    ledger.call(acked=want, events=[("lmdb", False, want)])
                    held.update(zip(want, slots, strict=True))
                    order += want
                    batches += 1
            finally:
                t.close()
            sessions += 1
        finally:
            if lock_fd >= 0:
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
                os.close(lock_fd)
        if turn_file is not None:
            time.sleep(0.001)  # let a waiting writer take the lock
    ledger.close()
    return {
        "batches": batches,
        "sessions": sessions,
        "failures": failures,
        "other_failures": other_failures,
    }


def store_files(path: str) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir())


# -- several processes sharing one LMDB store through the facade ------------------------------
def lmdb_cache_writer(
    path: str,
    bb: int,
    cap: int,
    proc: int,
    nprocs: int,
    per: int,
    seconds: float,
    seed: int,
    stop_file: str = "",
    log_path: str = "",
) -> dict:
    """Put chains of this process's ids into a shared LMDB store through a TierCache, and get
    ids another process stores; every block served must be exact. Runs for `seconds`, or
    until `stop_file` exists. Returns counters and the largest block count the store reported
    for the namespace while running.

    With `log_path` (for the crash campaign, which SIGKILLs writers): "W" before each put,
    "A id low next id low next ..." once it returned with every block held ("F" when some
    failed; see `StoreLedger.ack`: per id the lowest order seq the version it acknowledged can
    have, read from the store right after the put (the version held then), else right before
    it (the version held then, which the cache may have kept), else -1; and the store's next
    order seq before the put: every block the put stored has a higher one),
    "X id" for a block served with wrong bytes, "C n" for a namespace count over `cap` (one
    os.write per line: a SIGKILL never loses a line already written)."""
    from tiercache import TierCache
    from tiercache.tiers.lmdb.layout import COUNT_PREFIX, SEQ_KEY, head_seq, u64

    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if log_path else -1

    def log(line: str) -> None:
        if fd >= 0:
            os.write(fd, f"{line}\n".encode())

    rnd = random.Random(seed)
    # The removal log keeps a whole campaign's removals (the ledger reads them after kills).
    lmdb = {"kind": "lmdb", "blocks": cap, "path": path, "removals_kept": 1 << 18}
    cache = TierCache.open({"namespace": "fleet", "tiers": [lmdb]}, block_bytes=bb)
    tier = cache.tiers[-1]
    sh = tier._shared

    def seqs(txn: Any, ids: list[int]) -> list[int | None]:
        """The order seq each of `ids` is stored under in `txn`'s snapshot (None: not held)."""
        return [head_seq(txn.get(tier._nsb + key(i), db=sh.heads)) for i in ids]

    puts = own_hits = other_hits = misses = wrong = peak = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and not (stop_file and os.path.exists(stop_file)):
            mine = [proc * per + i for i in rnd.sample(range(per), 4)]
            with sh.env.begin() as txn:
                nxt = u64(txn.get(SEQ_KEY, db=sh.meta))
                was = seqs(txn, mine)
            log("W")
            held = cache.put([key(i) for i in mine], blocks(mine, bb))
            with sh.env.begin() as txn:
                now = seqs(txn, mine)
            # The version held right after the put, else right before it, else none (-1).
            low = [a if a is not None else b if b is not None else -1
                   for a, b in zip(now, was, strict=True)]  # fmt: skip
            acked = " ".join(f"{i} {s} {nxt}" for i, s in zip(mine, low, strict=True))
            log(f"A {acked}" if held == len(mine) else "F")
            puts += 1
            other = rnd.choice([p for p in range(nprocs) if p != proc])
            for i in (proc * per + rnd.randrange(per), other * per + rnd.randrange(per)):
                got = cache.get([key(i)])
                if len(got) == 0:
                    misses += 1
                elif not np.array_equal(got[0].numpy(), payload(i, bb)):
                    wrong += 1
                    log(f"X {i}")
                elif i // per == proc:
                    own_hits += 1
                else:
                    other_hits += 1
            with sh.env.begin() as txn:
                count = u64(txn.get(COUNT_PREFIX + tier._nsb, db=sh.meta))
            if count > cap:
                log(f"C {count}")
            peak = max(peak, count)
        errors = cache.stats()[tier.medium]["errors"]
        tstats = tier.stats()
    finally:
        cache.close()
        if fd >= 0:
            os.close(fd)
    return dict(
        puts=puts,
        own_hits=own_hits,
        other_hits=other_hits,
        misses=misses,
        wrong=wrong,
        errors=errors,
        peak=peak,
        read_failures=tstats["read_failures"],
        blocks_gone=tstats["blocks_gone"],
    )


def lmdb_snapshot_check(path: str, bb: int, cap: int, after: int = -1) -> dict:
    """A fresh opener of a store other processes are writing: in one read txn, the namespace's
    block count the store keeps, the entries it really holds and how many there are over the
    capacity; then every block a tier recovers is read, verified: exact, a plain miss (another
    process evicted it meanwhile), a counted failure or wrong bytes (with the ids read exact
    and wrong); then, after those reads, the store's removal log after `after`:
    [[id, order seq, record seq, reason]]."""
    from tiercache.tiers.lmdb.layout import COUNT_PREFIX, iter_prefix, u64

    t = open_tier("lmdb", path, bb, cap, namespace="fleet")
    try:
        sh = t._shared
        with sh.env.begin() as txn:
            count = u64(txn.get(COUNT_PREFIX + t._nsb, db=sh.meta))
            heads = sum(1 for _ in iter_prefix(txn.cursor(db=sh.heads), t._nsb, values=False))
            order = sum(1 for _ in iter_prefix(txn.cursor(db=sh.order), t._nsb, values=False))
        rec = t.recover()
        out = torch.empty((1, bb), dtype=torch.uint8)
        exact, wrong = [], []
        gone = failed = 0
        for k, s in rec:
            if t.read([s], out, [k]):
                if t.take_gone([k]):
                    gone += 1
                else:
                    failed += 1
            elif np.array_equal(out[0].numpy(), payload(key_id(k), bb)):
                exact.append(key_id(k))
            else:
                wrong.append(key_id(k))
        # After the reads: every block they found gone was removed before this, logged.
        removed = [[key_id(r.key), r.seq, r.at, r.reason] for r in t.removals(after)]
    finally:
        t.close()
    return dict(
        count=count, heads=heads, order=order, exact=len(exact), gone=gone, failed=failed,
        wrong=len(wrong), exact_ids=exact, wrong_ids=wrong, removed=removed,
    )  # fmt: skip


def lmdb_drop_unlogged(path: str, bb: int, cap: int, ids: list[int]) -> int:
    """Delete blocks of namespace "fleet" as a store without a removal log did (counts and
    order kept in step, nothing logged): a test of a ledger's test, which must then find
    them lost. How many it deleted."""
    from tiercache.tiers.lmdb.layout import StoreTxn

    t = open_tier("lmdb", path, bb, cap, namespace="fleet", lazy=True)
    try:
        sh = t._shared
        with sh.write_lock, sh.env.begin(write=True) as txn:
            store = StoreTxn(txn, sh.meta, sh.heads, sh.blocks, sh.order)  # no removal log
            n = 0
            for i in ids:
                n += txn.get(t._nsb + key(i), db=sh.heads) is not None
                store.delete(t._nsb + key(i), None)
            store.finish()
        return n
    finally:
        t.close()


def churn(tier: dict, bb: int, namespace: str, ids: list[int]) -> dict:
    """Open a TierCache of one tier (`tier`: its config table) on a store another process
    already wrote, then store `ids` four at a time; the tier's error count."""
    from tiercache import TierCache

    cache = TierCache.open({"namespace": namespace, "tiers": [tier]}, block_bytes=bb)
    try:
        for a in range(0, len(ids), 4):
            chunk = ids[a : a + 4]
            cache.put([key(i) for i in chunk], blocks(chunk, bb))
        stats = cache.stats()[cache.tiers[-1].medium]
    finally:
        cache.close()
    return {"errors": stats["errors"]}


def _wait_for(path: str, bound: float = 300.0) -> None:
    deadline = time.monotonic() + bound
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.002)


def lmdb_holder(path: str, bb: int, cap: int, w: int, ids: list[int], ctl: str) -> dict:
    """One of several processes holding a shared LMDB store open while the campaign damages
    it: store `ids` (this process's blocks), touch `ctl/stored-w`; once `ctl/read` exists,
    get every id 0..`max` alone (others' blocks are discovered on the lookup miss), touch
    `ctl/read-w`; once `ctl/store` exists, store and read back four new blocks (the store
    keeps serving; this write transaction also deletes the bad blocks this process found)."""
    from tiercache import TierCache

    config = {"namespace": "fleet", "tiers": [{"kind": "lmdb", "blocks": cap, "path": path}]}
    with TierCache.open(config, block_bytes=bb) as cache:
        cache.put([key(i) for i in ids], blocks(ids, bb))
        Path(ctl, f"stored-{w}").touch()
        _wait_for(os.path.join(ctl, "read"))
        hit, miss, wrong = gets(cache, json.loads(Path(ctl, "read").read_text()))
        errors = cache.stats()["lmdb"]["errors"]
        Path(ctl, f"read-{w}").touch()
        _wait_for(os.path.join(ctl, "store"))
        extra = [1_000_000 + 10 * w + j for j in range(4)]
        cache.put([key(i) for i in extra], blocks(extra, bb))
        back = cache.get([key(i) for i in extra])
        serving = len(back) == 4 and torch.equal(back, blocks(extra, bb))
    return {"hit": hit, "miss": miss, "wrong": wrong, "errors": errors, "serving": serving}


def lmdb_die_in_read_txn(path: str, bb: int, cap: int) -> None:
    """Open a shared LMDB store, begin a read transaction and die in it (SIGKILL): the
    reader table keeps this dead process's slot, pinning that snapshot's pages."""
    import signal

    t = open_tier("lmdb", path, bb, cap, namespace="fleet")
    txn = t._shared.env.begin()
    txn.get(b"x")
    os.kill(os.getpid(), signal.SIGKILL)


# -- first lookups after a lazy open -----------------------------------------------------------
def first_lookups(path: str, bb: int, capacity: int, ops: list, general: bool) -> dict[str, Any]:
    """Open namespace "a" of the LMDB store at `path` (lazily, as after a restart) and run
    `ops`: ["one", id, count] a one-key `lookup`, ["chain", ids] a chain `lookup`, ["get", id]
    a one-key `get` (a digest of the bytes served). `general`: the manager's one-key fast path
    is turned off, so every lookup takes the general loop (`_discover`). Returns the answers,
    the stats, the events, how often `_discover` ran, and the keys of "a" left in the store
    after the close (a malformed entry met is deleted at the close)."""
    import lmdb

    from tiercache import TierCache
    from tiercache.tiers.format import namespace_id
    from tiercache.tiers.lmdb import layout as lmdb_tier

    config = {"namespace": "a", "tiers": [{"kind": "lmdb", "blocks": capacity, "path": path}]}
    cache = TierCache.open(config, block_bytes=bb)
    manager = cache.manager
    if general:
        manager._lone = None  # type: ignore[attr-defined]
    discover, calls = manager._discover, [0]

    def counted(*args: Any) -> int:
        calls[0] += 1
        return discover(*args)

    manager._discover = counted  # type: ignore[method-assign]
    answers: list[Any] = []
    try:
        for op in ops:
            if op[0] == "one":
                answers.append(cache.lookup([key(op[1])], count=op[2]))
            elif op[0] == "chain":
                answers.append(cache.lookup([key(i) for i in op[1]]))
            else:
                rows = cache.get([key(op[1])])
                answers.append([len(rows), int(rows.to(torch.int64).sum())])
        stats = cache.stats()
        tier = {k: v for k, v in cache.tiers[0].stats().items() if not k.startswith("index_warm")}
        events = [[[k.hex() for k in e.keys], e.medium, e.removed] for e in cache.take_events()]
    finally:
        cache.close()
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=4, subdir=True)
    try:
        nsb = namespace_id("a").to_bytes(lmdb_tier.NS_BYTES, "big")
        with env.begin(db=env.open_db(lmdb_tier.HEADS_DB, create=False)) as txn:
            held = sorted(
                key_id(bytes(k[-16:]))
                for k in txn.cursor().iternext(values=False)
                if bytes(k[: len(nsb)]) == nsb
            )
    finally:
        env.close()
    return {
        "answers": answers,
        "stats": stats,
        "tier": tier,
        "events": events,
        "discover_calls": calls[0],
        "held_after": held,
    }


def lmdb_put_then_die(path: str, bb: int, cap: int, ids: list[int]) -> None:
    """Store `ids` in namespace "fleet" of a shared LMDB store in one write, then die
    (SIGKILL) the moment it returns: before anything could report what it evicted."""
    import signal

    t = open_tier("lmdb", path, bb, cap, namespace="fleet", lazy=True)  # free slots of its own
    ks = [key(i) for i in ids]
    t.write(t.allocate(ks), blocks(ids, bb), ks)
    os.kill(os.getpid(), signal.SIGKILL)
