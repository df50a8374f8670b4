"""Scale benchmark (issue 21): what a persistent store costs as it grows, through the facade.

Per tier kind (`--kinds`, default nvme and lmdb) and store size N (`--sizes`), a `TierCache`
with that one persistent tier of capacity N blocks (`--block-bytes`, default 4 KiB), each
step in a fresh process:
- fill: `put` N blocks (batches of `--batch`) into a new store, then `close`; blocks/s over
  the puts, and over the last tenth of them (flat costs keep both equal).
- open (clean): the store's files are dropped from the page cache (fsync, then
  POSIX_FADV_DONTNEED on those files only), and a fresh process opens the closed store and
  looks one key up. Reported: the seconds `TierCache.open` took, the anonymous RAM it added
  (RssAnon of /proc/self/status, before and after; per block), the bytes read by syscalls
  (`rchar`), the bytes read from disk (`read_bytes`: pages an mmap faulted in, readahead
  included) and the file-backed resident memory it added (RssFile) during the open. Then a
  second fresh process opens it again (the index's pages cached: "again").
- lookups: single-key `lookup` of random held keys, and 16-key chains (keys/s); reads: `get`
  of random 16-block batches (blocks/s, bytes checked).
- SIGKILL: a writer fills a second store and is SIGKILLed right after its last `put`
  returned (no close); a fresh process opens it (seconds, RAM), then checks that every key is
  found (`lookup`) and reads back `--verify` of them (default 20,000; `all`) byte for byte.
- raw py-lmdb (LMDB kinds, issue 35): right after the tier's fill, a fresh process puts the
  same keys and bytes (the same `rows`, uncompressed) into a new environment with py-lmdb's
  default flags (sync and metasync on, no writemap), `--raw-txn` puts per write transaction
  (default 64); blocks/s overall and over the last tenth. Reported with the tier's rate over
  it (tier/raw), and per kind the tier's fill rate at the largest size over the smallest.
Then a linear extrapolation of open time and RAM to 16.8 M blocks (1 TiB of 64 KiB blocks)
from the two largest sizes.

Run: .venv/bin/python bench/bench_scale.py --sizes 10k,100k [--kinds nvme] [--json out.json]
Disk: about N * (block + 4 KiB) twice (the clean and the killed store) per kind for NVMe;
each store is deleted after its size is measured. `--dir` picks the filesystem.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _child import child_json

TARGET_BLOCKS = 16_800_000  # 1 TiB of 64 KiB blocks


def key(i: int) -> bytes:
    """A hash-like 16-byte key for block i (as prefix hashes look)."""
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def rows(first: int, n: int, bb: int) -> np.ndarray:
    """Deterministic, distinct bytes for blocks first..first+n-1: cheap to make and check."""
    ids = np.arange(first, first + n, dtype=np.uint64)
    out = np.empty((n, bb), dtype=np.uint8)
    out[:] = (np.arange(bb, dtype=np.uint64)[None, :] * 31 + ids[:, None] * 7).astype(np.uint8)
    out[:, :8] = ids.view(np.uint8).reshape(n, 8)
    return out


def config(kind: str, path: str, n: int) -> dict[str, Any]:
    return {"namespace": "scale", "tiers": [{"kind": kind, "blocks": n, "path": path}]}


def proc_status() -> dict[str, int]:
    """RssAnon and RssFile (bytes) of this process, and rchar (bytes read by syscalls)."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                out[name] = int(rest.split()[0]) * 1024
    with open("/proc/self/io") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("rchar", "read_bytes"):
                out[name] = int(rest)
    return out


# -- children (each runs in a fresh interpreter) ------------------------------------------------
def child_fill(kind: str, path: str, n: int, bb: int, batch: int, kill: bool) -> dict[str, Any]:
    import torch

    from tiercache import TierCache

    cache = TierCache.open(config(kind, path, n), block_bytes=bb)
    t0 = time.perf_counter()
    tail_from, t_tail = n - max(1, n // 10), t0
    for s in range(0, n, batch):
        m = min(batch, n - s)
        if s >= tail_from and t_tail == t0:
            t_tail = time.perf_counter()
        got = cache.put([key(i) for i in range(s, s + m)], torch.from_numpy(rows(s, m, bb)))
        assert got == m, (s, got)
    t1 = time.perf_counter()
    if kill:  # the parent SIGKILLs us now: every put above has returned
        print(json.dumps({"filled": n}), flush=True)
        time.sleep(3600)
    cache.close()
    t2 = time.perf_counter()
    return {
        "fill_s": t1 - t0,
        "fill_rate": n / (t1 - t0),
        "fill_tail_rate": (n - tail_from) / (t1 - t_tail),
        "close_s": t2 - t1,
    }


def child_raw(path: str, n: int, bb: int, batch: int, per_txn: int) -> dict[str, Any]:
    """Raw py-lmdb on the tier's data: keys `key(i)`, values `rows(i)`, default flags."""
    import lmdb

    from tiercache.tiers.lmdb import map_size_for

    os.makedirs(path, mode=0o700)
    env = lmdb.open(path, map_size=map_size_for(n, bb), max_dbs=1, mode=0o600)
    db = env.open_db(b"blocks")
    t0 = time.perf_counter()
    tail_from, t_tail = n - max(1, n // 10), t0
    for s in range(0, n, batch):
        m = min(batch, n - s)
        if s >= tail_from and t_tail == t0:
            t_tail = time.perf_counter()
        data = rows(s, m, bb)
        for a in range(0, m, per_txn):
            with env.begin(write=True, db=db) as txn:
                for j in range(a, min(m, a + per_txn)):
                    txn.put(key(s + j), data[j])
    t1 = time.perf_counter()
    env.close()
    return {
        "fill_s": t1 - t0,
        "fill_rate": n / (t1 - t0),
        "fill_tail_rate": (n - tail_from) / (t1 - t_tail),
    }


def child_open(
    kind: str, path: str, n: int, bb: int, seconds: float, verify: int, check_all: bool
) -> dict[str, Any]:
    import gc

    from tiercache import TierCache

    gc.collect()
    before = proc_status()
    t0 = time.perf_counter()
    cache = TierCache.open(config(kind, path, n), block_bytes=bb)
    t1 = time.perf_counter()
    first = cache.lookup([key(n // 2)])
    t2 = time.perf_counter()
    after = proc_status()
    res: dict[str, Any] = {
        "open_s": t1 - t0,
        "first_lookup_s": t2 - t1,
        "first_hit": first,
        "ram_anon_per_block": (after["RssAnon"] - before["RssAnon"]) / n,
        "rss_file_added": after["RssFile"] - before["RssFile"],
        "read_syscall_bytes": after["rchar"] - before["rchar"],
        "read_disk_bytes": after["read_bytes"] - before["read_bytes"],
        "open_report": getattr(cache.tiers[0], "open_report", {}),
    }
    rnd = random.Random(1)
    keys = [key(rnd.randrange(n)) for _ in range(200_000)]
    # Single-key lookups, then 16-key chains, for `seconds` each: the first lookup of each
    # key since the open (a dormant block is taken over then), then the same keys again.
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and done < 190_000:
        for k in keys[done : done + 1000]:
            cache.lookup([k])
        done += 1000
    res["lookup_1_per_s"] = done / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for k in keys[:done]:
        cache.lookup([k])
    res["lookup_1_again_per_s"] = done / (time.perf_counter() - t0)
    starts = [rnd.randrange(max(1, n - 16)) for _ in range(12_100)]
    chains = [[key(i) for i in range(s, min(n, s + 16))] for s in starts]
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and done < 12_000:
        for c in chains[done : done + 100]:
            cache.lookup(c)
        done += 100
    res["lookup_16_keys_per_s"] = 16 * done / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for c in chains[:done]:
        cache.lookup(c)
    res["lookup_16_again_keys_per_s"] = 16 * done / (time.perf_counter() - t0)
    # Reads of random 16-block batches, checked byte for byte.
    done, bad, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        ids = rnd.sample(range(n), min(n, 16))
        got = cache.get([key(i) for i in ids]).numpy()
        want = np.concatenate([rows(i, 1, bb) for i in ids])
        bad += int(got.shape != want.shape or not np.array_equal(got, want))
        done += 16
    res["read_blocks_per_s"] = done / (time.perf_counter() - t0)
    res["read_bad_batches"] = bad
    # Only LMDB reports its index warm pass (NVMe keeps its index in memory: nothing to warm).
    tier_stats = getattr(cache.tiers[0], "stats", None)
    stats = tier_stats() if tier_stats is not None else {}
    res["index_warm"] = {k: v for k, v in stats.items() if k.startswith("index_warm_")}
    if verify:
        # Every key found; `verify` of them (all with check_all) read back exact.
        missing = sum(1 - cache.lookup([key(i)]) for i in range(n))
        ids = list(range(n)) if check_all else sorted(rnd.sample(range(n), min(n, verify)))
        wrong = 0
        for j in range(0, len(ids), 256):
            part = ids[j : j + 256]
            got = cache.get([key(i) for i in part])
            if got.shape[0] != len(part):
                wrong += len(part) - got.shape[0]
                continue
            want = np.concatenate([rows(i, 1, bb) for i in part])
            wrong += int((got.numpy() != want).any(axis=1).sum())
        res.update(missing=missing, verified=len(ids), wrong=wrong)
    cache.close()
    return res


# -- driver --------------------------------------------------------------------------------------
def run_child(args: list[str], timeout: float = 7200) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(args)]
    return child_json(cmd, timeout=timeout, what=f"child {args[0]}")


def fill_and_kill(kind: str, path: str, n: int, bb: int, batch: int) -> float:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        json.dumps(["fill", kind, path, n, bb, batch, True]),
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    assert p.stdout is not None
    line = p.stdout.readline()
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    if "filled" not in line:
        raise RuntimeError(f"the writer died before filling: {line!r}")
    return time.perf_counter() - t0


def parse_size(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s.rstrip("km")) * mult)


def drop_cached(path: str) -> None:
    """Evict the store's files from the page cache (POSIX_FADV_DONTNEED, after an fsync so
    no dirty page stays), so the open that follows reads from disk what it touches: its
    `read_disk_bytes` then counts the pages it needed (and the kernel's readahead)."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(kind: str, n: int, a: argparse.Namespace) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix=f"scale-{kind}-{n}-", dir=a.dir)
    try:
        clean, killed = os.path.join(base, "clean"), os.path.join(base, "killed")
        r: dict[str, Any] = {"kind": kind, "blocks": n, "block_bytes": a.block_bytes}
        r["fill"] = run_child(["fill", kind, clean, n, a.block_bytes, a.batch, False])
        if kind == "lmdb" and not a.no_raw:
            raw = os.path.join(base, "raw")
            r["raw"] = run_child(["raw", raw, n, a.block_bytes, a.batch, a.raw_txn])
            shutil.rmtree(raw)
        r["disk_bytes"] = sum(os.path.getsize(os.path.join(clean, f)) for f in os.listdir(clean))
        drop_cached(clean)
        r["open"] = run_child(["open", kind, clean, n, a.block_bytes, a.seconds, 0, False])
        # A second open, the index's pages now in the page cache (as after a quick restart).
        r["open_warm"] = run_child(["open", kind, clean, n, a.block_bytes, 0.05, 0, False])
        shutil.rmtree(clean)
        if not a.no_kill:
            fill_and_kill(kind, killed, n, a.block_bytes, a.batch)
            verify = n if a.verify == "all" else int(a.verify)
            r["killed"] = run_child(
                ["open", kind, killed, n, a.block_bytes, 0.5, verify, a.verify == "all"]
            )
        return r
    finally:
        shutil.rmtree(base, ignore_errors=True)


def row(r: dict[str, Any]) -> str:
    f, o, k, raw = r["fill"], r["open"], r.get("killed", {}), r.get("raw")
    return (
        f"{r['kind']:5} {r['blocks']:>9,} | fill {f['fill_rate']:>8,.0f}/s "
        f"(tail {f['fill_tail_rate']:>8,.0f}/s) close {f['close_s']:5.2f}s | "
        + (
            f"raw py-lmdb {raw['fill_rate']:>8,.0f}/s (tail {raw['fill_tail_rate']:>8,.0f}/s) "
            f"tier/raw {f['fill_rate'] / raw['fill_rate']:.2f} | "
            if raw
            else ""
        )
        + f"first lookup {o['first_lookup_s'] * 1e3:.1f} ms | "
        f"open {o['open_s']:6.2f}s (again {r['open_warm']['open_s']:5.2f}s) "
        f"RAM {o['ram_anon_per_block']:6.0f} B/blk "
        f"read {o['read_syscall_bytes'] / max(1, r['blocks']):7.0f} B/blk "
        f"disk {o['read_disk_bytes'] / max(1, r['blocks']):6.0f} B/blk "
        f"rssfile {o['rss_file_added'] / max(1, r['blocks']):6.0f} B/blk | "
        f"lookup {o['lookup_1_per_s']:>9,.0f}/s (again {o['lookup_1_again_per_s']:>9,.0f}/s) "
        f"chain16 {o['lookup_16_keys_per_s']:>10,.0f}/s "
        f"(again {o['lookup_16_again_keys_per_s']:>10,.0f}/s) "
        f"get {o['read_blocks_per_s']:>7,.0f} blk/s | "
        + (
            f"index warm {o['index_warm']['index_warm_pages']:,.0f} pages "
            f"{o['index_warm']['index_warm_seconds']:.2f}s | "
            if o.get("index_warm")
            else ""
        )
        + (
            f"killed: open {k['open_s']:6.2f}s RAM {k['ram_anon_per_block']:5.0f} B/blk "
            f"missing {k['missing']} wrong {k['wrong']} of {k['verified']} checked"
            if k
            else "killed: -"
        )
    )


def fill_ratios(results: list[dict[str, Any]]) -> list[str]:
    """Per kind: the fill rate at the largest size over the smallest (flat fills give 1)."""
    lines = []
    for kind in sorted({r["kind"] for r in results}):
        rs = sorted((r for r in results if r["kind"] == kind), key=lambda r: r["blocks"])
        if len(rs) >= 2:
            a, b = rs[0], rs[-1]
            lines.append(
                f"{kind}: fill rate at {b['blocks']:,} / at {a['blocks']:,}: "
                f"{b['fill']['fill_rate'] / a['fill']['fill_rate']:.2f}"
            )
    return lines


def extrapolate(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for kind in sorted({r["kind"] for r in results}):
        rs = sorted((r for r in results if r["kind"] == kind), key=lambda r: r["blocks"])
        if len(rs) < 2:
            continue
        a, b = rs[-2], rs[-1]

        def lin(get: Any, a: dict[str, Any] = a, b: dict[str, Any] = b) -> float:
            slope = (get(b) - get(a)) / (b["blocks"] - a["blocks"])
            return get(b) + slope * (TARGET_BLOCKS - b["blocks"])

        parts = [
            f"open {lin(lambda r: r['open']['open_s']):.1f} s",
            f"RAM {b['open']['ram_anon_per_block'] * TARGET_BLOCKS / 2**30:.2f} GiB "
            f"({b['open']['ram_anon_per_block']:.0f} B/blk)",
        ]
        if "killed" in b and "killed" in a:
            parts.append(f"open after SIGKILL {lin(lambda r: r['killed']['open_s']):.1f} s")
        lines.append(
            f"{kind}: extrapolated to {TARGET_BLOCKS:,} blocks from {a['blocks']:,} and "
            f"{b['blocks']:,}: " + ", ".join(parts)
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default="nvme,lmdb")
    p.add_argument("--sizes", default="10k,100k", help="e.g. 10k,100k,1m")
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--batch", type=int, default=256, help="blocks per put")
    p.add_argument("--seconds", type=float, default=1.0, help="per lookup/read measurement")
    p.add_argument("--verify", default="20000", help="blocks read back after SIGKILL, or all")
    p.add_argument("--no-kill", action="store_true", help="skip the SIGKILL measurement")
    p.add_argument("--no-raw", action="store_true", help="skip raw py-lmdb (LMDB kinds)")
    p.add_argument("--raw-txn", type=int, default=64, help="raw py-lmdb puts per write txn")
    p.add_argument("--dir", default=None, help="where the stores go (default: $TMPDIR)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        args = json.loads(a.child)
        fn = {"fill": child_fill, "open": child_open, "raw": child_raw}[args[0]]
        print(json.dumps(fn(*args[1:])), flush=True)
        return
    results = []
    for n in map(parse_size, a.sizes.split(",")):
        for kind in a.kinds.split(","):
            r = measure(kind, n, a)
            results.append(r)
            print(row(r), flush=True)
    for line in fill_ratios(results) + extrapolate(results):
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
