"""Redis tier vs raw redis-py pipelined SET/GET: same run, same server, same value size, same
pipeline depth.

Per run (medians over --runs; raw and tier interleaved so drift hits both):
- put: --blocks values in batches of --depth. raw = one non-transactional pipeline of `depth`
  SETs of ready-made `bytes` values per batch; tier = RedisTier(compression="none").write of
  the same rows from a uint8 tensor (header + xxh3 checksum per block, one pipeline).
- get: shuffled keys, batches of --depth. raw = one pipeline of `depth` GETs (the bytes
  objects redis-py returns, nothing more); tier = read() into a preallocated tensor (header,
  key, namespace and checksum verified, copied into the tensor).
- raw and tier alternate batch by batch within a pass (and which goes first alternates), so
  load from other processes on a shared machine hits both alike; the headline ratio is the
  median over runs of (tier rate / raw rate) within each run.
- the benchmark's keys are deleted between passes, so every pass stores into an empty store.

By default the benchmark starts its own redis-server (no persistence) on a free loopback
port; --url points it at another one (its keys under "bench:" are deleted).
Run: .venv/bin/python bench/bench_redis.py [--value-kib 256] [--depth 32]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis
import torch

from tiercache.tiers.redis import RedisTier

KiB, MiB = 1 << 10, 1 << 20


@contextmanager
def local_server() -> Iterator[str]:
    with redis_server() as (url, _):
        yield url


@contextmanager
def redis_server() -> Iterator[tuple[str, subprocess.Popen]]:
    """A redis-server of its own (no persistence) on a free loopback port: (url, process)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed; pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="bench-redis-")
    proc = subprocess.Popen(
        [
            *(exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", d),
            *("--save", "", "--appendonly", "no", "--daemonize", "no"),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        c = redis.Redis(port=port)
        for _ in range(200):
            try:
                c.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        c.close()
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def clear(c: redis.Redis) -> None:
    keys = list(c.scan_iter(match=b"bench:*", count=1000))
    for i in range(0, len(keys), 1000):
        c.delete(*keys[i : i + 1000])


def raw_put(c: redis.Redis, rkeys: list[bytes], values: list[bytes]) -> float:
    """One pipeline of SETs of ready-made `bytes` values; seconds."""
    t0 = time.perf_counter()
    pipe = c.pipeline(transaction=False)
    for k, v in zip(rkeys, values, strict=True):
        pipe.set(k, v)
    pipe.execute()
    return time.perf_counter() - t0


def raw_get(c: redis.Redis, rkeys: list[bytes]) -> float:
    """One pipeline of GETs (the bytes redis-py returns, nothing more); seconds."""
    t0 = time.perf_counter()
    pipe = c.pipeline(transaction=False)
    for k in rkeys:
        pipe.get(k)
    got = pipe.execute()
    t = time.perf_counter() - t0
    assert all(v is not None for v in got)
    return t


def tier_put(tier: RedisTier, src: torch.Tensor, keys: list[bytes]) -> float:
    t0 = time.perf_counter()
    slots = tier.allocate(keys)
    assert slots is not None
    tier.write(slots, src, keys)
    return time.perf_counter() - t0


def tier_get(tier: RedisTier, keys: list[bytes], slots: list[int], dst: torch.Tensor) -> float:
    t0 = time.perf_counter()
    failed = tier.read(slots, dst[: len(keys)], keys)
    t = time.perf_counter() - t0
    assert not failed, failed
    return t


def one_run(url, src, values, keys, order, depth, dst) -> dict[str, float]:
    """Seconds per side of one pass. Raw and tier alternate batch by batch (and which goes
    first alternates too), so load from other processes on a shared machine hits both."""
    c = redis.Redis.from_url(url)
    clear(c)
    tier = RedisTier(
        url=url,
        block_bytes=src.shape[1],
        capacity_blocks=len(keys),
        prefix="bench:tier:",
        namespace="bench",
        compression="none",
    )
    t = dict.fromkeys(("raw_put", "tier_put", "raw_get", "tier_get"), 0.0)
    slot_of: dict[bytes, int] = {}
    try:
        for b, s in enumerate(range(0, len(keys), depth)):
            ks = keys[s : s + depth]
            rks = [b"bench:raw:" + k for k in ks]
            for side in ("raw", "tier") if b % 2 == 0 else ("tier", "raw"):
                if side == "raw":
                    t["raw_put"] += raw_put(c, rks, values[s : s + depth])
                else:
                    t["tier_put"] += tier_put(tier, src[s : s + depth], ks)
        slot_of = {k: i for i, k in enumerate(keys)}  # slots are handed out in order
        for b, s in enumerate(range(0, len(order), depth)):
            ks = order[s : s + depth]
            for side in ("raw", "tier") if b % 2 == 0 else ("tier", "raw"):
                if side == "raw":
                    t["raw_get"] += raw_get(c, [b"bench:raw:" + k for k in ks])
                else:
                    t["tier_get"] += tier_get(tier, ks, [slot_of[k] for k in ks], dst)
    finally:
        tier.close()
        clear(c)
        c.close()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--value-kib", type=float, default=256, help="block size in KiB")
    ap.add_argument("--blocks", type=int, default=512, help="blocks per pass")
    ap.add_argument("--depth", type=int, default=32, help="commands per pipeline / per call")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1, help="uncounted runs first")
    ap.add_argument("--url", default=None, help="an existing server (default: start one)")
    args = ap.parse_args()
    bb = int(args.value_kib * KiB)
    n, depth = args.blocks, args.depth
    total = n * bb
    rnd = random.Random(0)
    keys = [rnd.randbytes(16) for _ in range(n)]
    order = keys[:]
    rnd.shuffle(order)
    src = torch.randint(
        0, 256, (n, bb), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    values = [src[i].numpy().tobytes() for i in range(n)]
    dst = torch.zeros((depth, bb), dtype=torch.uint8)
    with local_server() if args.url is None else _given(args.url) as url:
        info = redis.Redis.from_url(url).info("server")
        print(
            f"# redis-server {info['redis_version']}, redis-py {redis.__version__}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}"
        )
        print(
            f"# value {bb} B, {n} blocks ({total / MiB:.0f} MiB) per pass, pipeline depth "
            f"{depth}, {args.runs} runs after {args.warmup} warm-up"
        )
        res: dict[str, list[float]] = {}
        for r in range(-args.warmup, args.runs):
            t = one_run(url, src, values, keys, order, depth, dst)
            if r >= 0:
                for k, v in t.items():
                    res.setdefault(k, []).append(v)
                for op in ("put", "get"):  # tier rate / raw rate within the run
                    res.setdefault(f"ratio_{op}", []).append(t[f"raw_{op}"] / t[f"tier_{op}"])
            rate = {k: total / v / 1e6 for k, v in t.items()}
            print(
                f"# run {r + 1}/{args.runs}{' (warm-up)' if r < 0 else ''}: put raw "
                f"{rate['raw_put']:.0f} tier {rate['tier_put']:.0f} MB/s, get raw "
                f"{rate['raw_get']:.0f} tier {rate['tier_get']:.0f} MB/s",
                flush=True,
            )
    m = {k: total / statistics.median(v) / 1e6 for k, v in res.items() if "ratio" not in k}
    print(f"raw  put {m['raw_put']:7.0f} MB/s  (pipelined SET of bytes values)")
    print(f"tier put {m['tier_put']:7.0f} MB/s  (compression=none, header + checksum)")
    print(f"raw  get {m['raw_get']:7.0f} MB/s  (pipelined GET, bytes returned)")
    print(f"tier get {m['tier_get']:7.0f} MB/s  (verified, copied into a tensor)")
    for op in ("put", "get"):
        per_run = res[f"ratio_{op}"]
        print(
            f"RATIO redis_{op}/raw_{op} = {statistics.median(per_run):.2f}  (median of per-run "
            f"ratios, range {min(per_run):.2f}-{max(per_run):.2f}; ratio of median rates "
            f"{m[f'tier_{op}'] / m[f'raw_{op}']:.2f}; target >= 0.80)"
        )


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url


if __name__ == "__main__":
    main()
