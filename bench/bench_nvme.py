"""NVMe tier throughput against raw O_DIRECT pwrite/pread of the same bytes, in the same run.

Both sides move the same slot images (64-byte header + payload, padded to the tier's slot size)
to the same offsets in the same shuffled order, in batches of `--batch` blocks waited for one
batch at a time, on a pool of `--threads` threads (the tier's `io_threads`). The raw side does
nothing but the I/O from prepared aligned buffers: no copy, no checksum, no index. Writes end
with one fdatasync (raw) / `flush()` (tier); reads are cold (O_DIRECT, or fadvise DONTNEED on a
filesystem without it). Runs alternate raw/tier so drift hits both alike; medians are printed.

    .venv/bin/python bench/bench_nvme.py [--dir DIR] [--block-kib 2048] [--total-mib 256]
        [--runs 9] [--threads 4] [--batch 32] [--fsync batch] [--aiofiles]

`--aiofiles` adds the measurement behind the tier's choice of a plain thread pool: the same
cold O_DIRECT reads through aiofiles (an asyncio wrapper that also runs blocking calls on a
thread pool) with `--threads` coroutines in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from tiercache.tiers.format import HEADER_SIZE, encode_block, namespace_id
from tiercache.tiers.nvme import NVMeTier


def evict(fd: int) -> None:
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class Raw:
    """The baseline: O_DIRECT pwrite/preadv of prepared slot images, nothing else."""

    def __init__(
        self, path: str, images: mmap.mmap, slot_bytes: int, n: int, threads: int, direct: bool
    ) -> None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        os.posix_fallocate(self.fd, 0, n * slot_bytes)
        self.slot_bytes = slot_bytes
        self.view = memoryview(images)
        self.pool = ThreadPoolExecutor(threads)
        self.tls = threading.local()

    def _write(self, slot: int) -> None:
        sb = self.slot_bytes
        if os.pwrite(self.fd, self.view[slot * sb : (slot + 1) * sb], slot * sb) != sb:
            raise OSError("short write")

    def _read(self, slot: int) -> None:
        buf = getattr(self.tls, "buf", None)
        if buf is None:
            buf = self.tls.buf = mmap.mmap(-1, self.slot_bytes)
        if os.preadv(self.fd, [buf], slot * self.slot_bytes) != self.slot_bytes:
            raise OSError("short read")

    def write(self, batches: list[list[int]]) -> None:
        for b in batches:
            list(self.pool.map(self._write, b))
        os.fdatasync(self.fd)

    def read(self, batches: list[list[int]]) -> None:
        for b in batches:
            list(self.pool.map(self._read, b))

    def close(self) -> None:
        self.pool.shutdown()
        self.view.release()
        os.close(self.fd)


def aiofiles_read(path: str, slot_bytes: int, slots: list[int], conc: int) -> None:
    """Cold O_DIRECT reads of `slots` through aiofiles, `conc` coroutines in flight."""
    import aiofiles

    async def main() -> None:
        it = iter(slots)

        async def worker() -> None:
            buf = mmap.mmap(-1, slot_bytes)
            opener = lambda p, f: os.open(p, f | os.O_DIRECT)  # noqa: E731
            async with aiofiles.open(path, "rb", buffering=0, opener=opener) as f:
                for s in it:
                    await f.seek(s * slot_bytes)
                    if await f.readinto(buf) != slot_bytes:
                        raise OSError("short read")

        await asyncio.gather(*(worker() for _ in range(conc)))

    asyncio.run(main())


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="directory for the files (default: a temp dir under /tmp)")
    ap.add_argument("--block-kib", type=int, default=2048)
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="blocks per tier.write/read call")
    ap.add_argument("--fsync", default="batch", choices=["never", "batch", "always"])
    ap.add_argument("--aiofiles", action="store_true", help="also time reads via aiofiles")
    args = ap.parse_args(argv)

    bb = args.block_kib * 1024
    n = max(1, args.total_mib * 1024 * 1024 // bb)
    work = tempfile.mkdtemp(prefix="tiercache-bench-nvme-", dir=args.dir or "/tmp")
    try:
        tier = NVMeTier(
            block_bytes=bb,
            capacity_blocks=n,
            path=os.path.join(work, "tier"),
            fsync=args.fsync,
            io_threads=args.threads,
            namespace="bench",
        )
        sb = tier.slot_bytes
        keys = [i.to_bytes(16, "big") for i in range(n)]
        slots = tier.allocate(keys)
        assert slots == list(range(n))
        src = torch.randint(
            0, 256, (n, bb), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        )
        # The raw side writes exactly the bytes the tier writes: header + payload + padding.
        images = mmap.mmap(-1, n * sb)
        ns = namespace_id("bench")
        for i in range(n):
            head, _ = encode_block(keys[i], src[i].numpy(), namespace=ns, seq=i + 1)
            images[i * sb : i * sb + HEADER_SIZE] = head
            images[i * sb + HEADER_SIZE : i * sb + HEADER_SIZE + bb] = src[i].numpy().tobytes()
        raw = Raw(os.path.join(work, "raw.bin"), images, sb, n, args.threads, tier.direct)
        order = list(range(n))
        random.Random(1).shuffle(order)
        batches = [order[i : i + args.batch] for i in range(0, n, args.batch)]
        src_b = [src[b] for b in batches]
        dst = torch.empty_like(src)
        dst_b = [torch.empty((len(b), bb), dtype=torch.uint8) for b in batches]

        def tier_write() -> None:
            for b, s in zip(batches, src_b, strict=True):
                tier.write(b, s, [keys[i] for i in b])
            tier.flush()

        def tier_read() -> None:
            for b, d in zip(batches, dst_b, strict=True):
                if tier.read(b, d, [keys[i] for i in b]):
                    raise RuntimeError("tier read failed verification")

        def cold() -> None:
            if not tier.direct:
                evict(tier._fd)
                evict(raw.fd)

        res: dict[str, list[float]] = {
            k: [] for k in ("raw_pwrite", "nvme_write", "raw_pread", "nvme_read", "aiofiles")
        }

        def aio() -> None:
            aiofiles_read(os.path.join(work, "raw.bin"), sb, order, args.threads)

        steps = [
            ("raw_pwrite", lambda: raw.write(batches)),
            ("nvme_write", tier_write),
            ("raw_pread", lambda: raw.read(batches)),
            ("nvme_read", tier_read),
        ]
        for r in range(args.runs):
            # Pairs run back to back, in alternating order, so drift and a busy neighbour hit
            # both sides of each ratio alike.
            for pair in (steps[0:2], steps[2:4]):
                for name, fn in pair if r % 2 == 0 else pair[::-1]:
                    if name.endswith("read"):
                        cold()
                    res[name].append(timed(fn))
            if args.aiofiles:
                cold()
                res["aiofiles"].append(timed(aio))
        for b, d in zip(batches, dst_b, strict=True):
            dst[b] = d
        assert torch.equal(dst, src), "the tier read back different bytes"

        payload = n * bb
        print(
            f"# {n} blocks of {bb} bytes (slot {sb}), {args.runs} runs, threads={args.threads}"
            f", batch={args.batch}, fsync={args.fsync}, direct={tier.direct}, dir={work}, "
            f"python {sys.version.split()[0]}, torch {torch.__version__}"
        )
        med: dict[str, float] = {}
        for k, secs in res.items():
            if not secs:
                continue
            rates = sorted(payload / s / 1e6 for s in secs)
            med[k] = statistics.median(rates)
            print(
                f"RESULT {k} {med[k]:.0f} MB/s (n={len(rates)} min={rates[0]:.0f} "
                f"max={rates[-1]:.0f})"
            )
        print(f"RATIO nvme_write/raw_pwrite = {med['nvme_write'] / med['raw_pwrite']:.3f}")
        print(f"RATIO nvme_read/raw_pread = {med['nvme_read'] / med['raw_pread']:.3f}")
        # Secondary: per-run ratios (each tier run against the raw run next to it).
        for a, b in (("nvme_write", "raw_pwrite"), ("nvme_read", "raw_pread")):
            per = sorted(x / y for x, y in zip(res[b], res[a], strict=True))  # seconds: raw/tier
            print(
                f"# per-run {a}/{b}: median {statistics.median(per):.3f} "
                f"min {per[0]:.3f} max {per[-1]:.3f}"
            )
        if "aiofiles" in med:
            print(f"RATIO aiofiles_read/raw_pread = {med['aiofiles'] / med['raw_pread']:.3f}")
        raw.close()
        tier.close()
        images.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
