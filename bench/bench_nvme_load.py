"""NVMe hits into a CPU engine's blocks: one copy (`read_to`) against staged, in the same run.

The engine is `bench_vllm_ttft`'s model (6 layers, fp32, per layer one tensor
`[2, blocks, 4 KV heads, 32 tokens, 64]`), stored as head shards by default (4 slots of
96 KiB per block, as the connector stores it) or whole blocks (`--whole`). A "request" is
`--blocks` blocks (default 64: 2,048 tokens, 24.8 MB) loaded from the NVMe tier into engine
blocks the way `DiskHandler` loads them on a CPU engine:
- `staged` (before issue 35): `NVMeTier.read` into a staging tensor (verify, then copy into
  the row), then `KVLayout.scatter` from it: two copies;
- `one_copy`: `NVMeTier.read_to`, whose sink scatters each run's verified rows straight from
  the tier's aligned read buffer: one copy;
- `raw`: cold O_DIRECT preads of the same slots by `bench_nvme.Raw` (4 threads, no
  checksum, no copy): the disk alone.
Reads are cold (O_DIRECT). The three alternate in rotation, `--runs` times over `--requests`
requests each; medians per request are printed, and the loaded bytes are checked.

    .venv/bin/python bench/bench_nvme_load.py [--runs 7] [--requests 8] [--blocks 64] [--whole]
"""

from __future__ import annotations

import argparse
import importlib.util
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tiercache.tiers.nvme import NVMeTier
from tiercache.transfer import KVLayout

LAYERS, TOKENS, HEADS, DIM = 6, 32, 4, 64


def _bench_nvme():
    path = Path(__file__).with_name("bench_nvme.py")
    spec = importlib.util.spec_from_file_location("tc_bench_nvme", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per request")
    ap.add_argument("--whole", action="store_true", help="whole blocks, not head shards")
    ap.add_argument("--dir", help="directory for the files (default: a temp dir under /tmp)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shards = 1 if args.whole else HEADS
    nb = args.blocks * args.requests  # engine blocks: every request has its own
    g = torch.Generator().manual_seed(0)
    # vLLM's CPU layout (heads outermost in a block, "LBHNC"); head-shard units are views of
    # it, `[2, blocks * shards, heads / shards, tokens, dim]`, as `HeadShards.unit_views` makes.
    caches = {
        f"layer.{i}": torch.randn(2, nb, HEADS, TOKENS, DIM, generator=g).view(
            2, nb * shards, HEADS // shards, TOKENS, DIM
        )
        for i in range(LAYERS)
    }
    units = nb * shards
    layout = KVLayout(caches, units)
    bb = layout.block_bytes
    work = tempfile.mkdtemp(prefix="tiercache-bench-nvme-load-", dir=args.dir or "/tmp")
    try:
        tier = NVMeTier(
            block_bytes=bb,
            capacity_blocks=units,
            path=os.path.join(work, "tier"),
            io_threads=4,
            namespace="bench",
        )
        keys = [i.to_bytes(16, "big") for i in range(units)]
        slots = tier.allocate(keys)
        assert slots == list(range(units))
        stored = torch.empty((units, bb), dtype=torch.uint8)
        layout.gather(list(range(units)), stored)
        tier.write(slots, stored, keys)
        tier.flush()
        per = args.blocks * shards
        reqs = [list(range(r * per, (r + 1) * per)) for r in range(args.requests)]
        staging = torch.empty((per, bb), dtype=torch.uint8)
        nvme = _bench_nvme()
        images = mmap.mmap(-1, units * tier.slot_bytes)
        raw = nvme.Raw(
            os.path.join(work, "raw.bin"), images, tier.slot_bytes, units, 4, tier.direct
        )
        raw.write([s[i : i + 32] for s in reqs for i in range(0, per, 32)])

        def staged(ids: list[int]) -> None:
            if tier.read(ids, staging, [keys[i] for i in ids]):
                raise RuntimeError("verification failed")
            layout.scatter(ids, staging)

        def one_copy(ids: list[int]) -> None:
            def sink(pos: list[int], rows: torch.Tensor) -> None:
                layout.scatter([ids[i] for i in pos], rows)

            if tier.read_to(ids, sink, [keys[i] for i in ids]):
                raise RuntimeError("verification failed")

        def raw_read(ids: list[int]) -> None:
            raw.read([ids[i : i + 32] for i in range(0, per, 32)])

        modes = {"staged": staged, "one_copy": one_copy, "raw": raw_read}
        res: dict[str, list[float]] = {m: [] for m in modes}
        names = list(modes)
        for r in range(args.runs):
            for name in names[r % 3 :] + names[: r % 3]:
                for t in caches.values():
                    t.zero_()
                times = []
                for ids in reqs:
                    t0 = time.perf_counter()
                    modes[name](ids)
                    times.append(time.perf_counter() - t0)
                res[name].append(statistics.median(times))
                if name != "raw":  # every engine block holds what was stored
                    got = torch.empty_like(stored)
                    layout.gather(list(range(units)), got)
                    assert torch.equal(got, stored), name
        raw.close()
        tier.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = per * bb / 1e6
    print(
        f"{args.requests} requests x {args.blocks} blocks ({'whole' if shards == 1 else shards}"
        f" {'blocks' if shards == 1 else 'head shards'} of {bb} B) = {mb:.1f} MB a request,"
        f" O_DIRECT {tier.direct}; medians per request over {args.runs} runs"
    )
    med = {m: statistics.median(v) for m, v in res.items()}
    for m, v in res.items():
        print(
            f"{m:9s} {med[m] * 1e3:6.2f} ms ({mb / med[m] / 1e3:5.2f} GB/s)  runs: "
            + ", ".join(f"{x * 1e3:.2f}" for x in v)
        )
    ratios = [a / b for a, b in zip(res["one_copy"], res["staged"], strict=True)]
    print(
        f"one_copy/staged {statistics.median(ratios):.3f} (runs: "
        + ", ".join(f"{x:.3f}" for x in ratios)
        + f"); one_copy/raw {med['one_copy'] / med['raw']:.3f}, staged/raw "
        f"{med['staged'] / med['raw']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
