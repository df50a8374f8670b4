"""Multi-writer LMDB throughput vs one writer, same run: N processes each put --puts batches
of --batch blocks (distinct keys) into one store of --capacity blocks (the store evicts its
oldest beyond it, in the same transactions); blocks/s summed over the writers.

Run: .venv/bin/python bench/bench_lmdb_shared.py [--writers 1 3] [--block-kib 16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time

import torch

from tiercache.tiers.lmdb import LMDBTier


def writer(path: str, bb: int, cap: int, proc: int, puts: int, batch: int, go, out) -> None:
    t = LMDBTier(path=path, block_bytes=bb, capacity_blocks=cap, compression="none")
    src = torch.randint(0, 256, (batch, bb), dtype=torch.uint8)
    held: list[int] = []
    go.wait()
    t0 = time.perf_counter()
    for p in range(puts):
        keys = [(proc << 40 | p * batch + i).to_bytes(16, "big") for i in range(batch)]
        if t.free_blocks < batch:
            t.free(held[:batch])
            del held[:batch]
        slots = t.allocate(keys)
        t.write(slots, src, keys)
        held += slots
    t.flush()
    out.put(time.perf_counter() - t0)
    t.close()


def run(n: int, bb: int, cap: int, puts: int, batch: int) -> float:
    d = tempfile.mkdtemp(prefix="bench-lmdb-shared-")
    try:
        LMDBTier(path=d + "/s", block_bytes=bb, capacity_blocks=cap).close()
        go, out = mp.Event(), mp.Queue()
        ps = [
            mp.Process(target=writer, args=(d + "/s", bb, cap, p, puts, batch, go, out))
            for p in range(n)
        ]
        for p in ps:
            p.start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        go.set()
        for p in ps:
            p.join()
        wall = time.perf_counter() - t0
        return n * puts * batch / wall
    finally:
        shutil.rmtree(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--writers", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--block-kib", type=int, default=16)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--puts", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    rates = {n: run(n, a.block_kib * 1024, a.capacity, a.puts, a.batch) for n in a.writers}
    base = rates[a.writers[0]]
    for n, r in rates.items():
        print(f"writers={n}: {r:,.0f} blocks/s ({r / base:.2f}x of {a.writers[0]} writer(s))")


if __name__ == "__main__":
    mp.set_start_method("fork")
    main()
