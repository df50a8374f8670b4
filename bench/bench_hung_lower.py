"""Blocks served while the lower tier hangs (issue 35): a CPU tier over a SIGSTOPped Redis.

Per round: a fresh cache, CPU (--blocks) over Redis written back, filled with chains of 4
blocks whose bytes are their keys repeated; the redis-server is SIGSTOPped; a put of 2 new
blocks starts on a thread (its store demotes 2 CPU blocks into Redis: the write waits on the
stopped server); then every chain is read once. Reported per round: the CPU-tier blocks
served and verified whole, the round's time, and whether the put was still hung when the
round ended (a round that waited for the put did not read beside it). Then SIGCONT.

Run: .venv/bin/python bench/bench_hung_lower.py [--blocks 360] [--rounds 3] [--timeout 3]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_redis import redis_server

from tiercache import TierCache

BB = 4096


def rows(keys: list[bytes]) -> torch.Tensor:
    """Each block is its key, repeated."""
    data = bytearray(b"".join(k * (BB // 16) for k in keys))
    return torch.frombuffer(data, dtype=torch.uint8).view(len(keys), BB)


def one_round(url: str, proc, blocks: int, timeout: float, n: int) -> tuple[int, float, bool]:
    cfg = {
        "block_size": 4,
        "promote": False,
        "namespace": f"bench-hung-{n}",
        "tiers": [
            {"kind": "cpu", "blocks": blocks},
            {
                "kind": "redis",
                "url": url,
                "prefix": f"bench-hung-{n}:",
                "blocks": 4 * blocks,
                "timeout": timeout,
                "write_policy": "write-back",
            },
        ],
    }
    cache = TierCache.open(cfg, block_bytes=BB)
    chains = [cache.hash_tokens(list(range(i * 1000, i * 1000 + 16))) for i in range(blocks // 4)]
    for c in chains:
        cache.put(c, rows(c))
    new = cache.hash_tokens(list(range(10**7, 10**7 + 8)))
    proc.send_signal(signal.SIGSTOP)
    try:
        t = threading.Thread(target=cache.put, args=(new, rows(new)))
        t.start()
        time.sleep(0.2)  # the put's demotion is waiting on the stopped server
        t0 = time.monotonic()
        whole = 0
        for c in chains:
            got = cache.get(c)
            if torch.equal(got, rows(c[: got.shape[0]])):
                whole += got.shape[0]
        dt = time.monotonic() - t0
        hung = t.is_alive()
    finally:
        proc.send_signal(signal.SIGCONT)
    t.join(timeout + 5)
    cache.close()
    return whole, dt, hung


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=360)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3.0, help="Redis socket timeout (s)")
    args = ap.parse_args()
    with redis_server() as (url, proc):
        times = []
        for n in range(args.rounds):
            whole, dt, hung = one_round(url, proc, args.blocks, args.timeout, n)
            times.append(dt)
            print(
                f"round {n + 1}: {whole} of {args.blocks} CPU-tier blocks served whole in "
                f"{dt:.3f} s; the put still hung at the round's end: {hung}"
            )
    print(f"median round: {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
