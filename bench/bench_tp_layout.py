"""What the TP-independent layout (head shards, issue 32, docs/tp-layout.md) costs a same-TP
engine: store and load time per token, head shards against whole blocks, same run.

Today a TP rank stores one key per block: its heads of every layer. With head shards it stores
`S/n` keys per block (`S` shards of `H/S` heads; rank `r` of TP=`n` owns `S/n` of them), each
a tier block with its own header and checksum. Measured through the real transfer engine, as
the KV connector drives it (`tiercache/connectors/vllm_kv/worker.py`): the keys and engine ids
(`HeadShards.keys`, `HeadShards.units`, the shard variants only), `manager.prepare_store` ->
`store_transfers` -> `OffloadingWorker.transfer_async` -> wait -> `complete_store`, and
`prepare_load` -> `load_transfers` -> wait -> `complete_load`; `KVLayout` over the engine
buffer (whole blocks) or over `HeadShards.unit_views` of it (shards). Real tiers from
`TierCache.open` with their default settings: CPU, NVMe (files in a temp dir, O_DIRECT where
the filesystem allows) and LMDB (zstd level 1), one tier per cache.

The engine buffer is vLLM's CPU layout: one allocation `[layers, num_blocks, heads, block,
2*head]`, each layer a view of it; random normal values (bf16 or fp32). A TP=2 rank's
engine holds half the heads. Per run, `--jobs` jobs of `--blocks` blocks (new tokens each run),
each job submitted and waited for alone (one request's store, then its load), engine block
ids scattered at random; the loaded blocks are checked bit for bit against the stored ones;
at the end of a run its blocks are dropped (`manager.discard`) so the next run stores again.

Variants, each against the whole-block baseline of its own TP size measured in the same run
(the ratio is shard time / baseline time per run; > 1 = the layout costs):
- `whole TP=1`, `whole TP=2 r0`: today, one key per block (the baselines);
- `S=<max> TP=1`: `max = default_shards(heads)` (8 for 8 KV heads) keys per block;
- `S=<max> TP=2 r0`: rank 0 of TP=2, `max/2` keys per block;
- `S=2 TP=1`: 2 keys per block.
The variants take turns job by job, in an order rotated every job, so drift and order hit
all alike.
Printed: medians in microseconds per token and every run, then the median of the per-run
ratios and every run's ratio.

Models (`--models`): `large`: 16 layers, 8 KV heads of 128, block 32 tokens, bf16 (a 2 MiB
block at TP=1, a 256 KiB shard at S=8); `tiny`: the vLLM tests' model shape, 2 layers,
head 32, block 32, fp32, with `--tiny-heads` KV heads (default 4; the test model has 2);
`ttft`: `bench_vllm_ttft.py`'s model, 6 layers, 4 KV heads of 64, block 32, fp32 (a 384 KiB
block at TP=1, a 96 KiB shard at S=4).

Run: .venv/bin/python bench/bench_tp_layout.py [--models large,tiny,ttft] [--tiers cpu,nvme,lmdb]
         [--blocks 8] [--jobs 4] [--runs 7] [--dir DIR]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tiercache import TierCache
from tiercache.hashing import prefix_hashes
from tiercache.transfer import KVLayout, OffloadingWorker, build_worker
from tiercache.transfer.head_shards import HeadShards, default_shards
from tiercache.transfer.specs import load_transfers, store_transfers


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    heads: int
    head: int
    block: int
    dtype: torch.dtype

    def block_bytes(self, tp: int) -> int:
        return self.layers * self.heads // tp * self.block * 2 * self.head * self.dtype.itemsize


@dataclass
class Variant:
    """One way of storing: `shards` None = whole blocks (today)."""

    name: str
    tp: int
    shards: HeadShards | None
    cache: TierCache | None = None
    worker: OffloadingWorker | None = None

    @property
    def baseline(self) -> str:
        return "whole TP=1" if self.tp == 1 else "whole TP=2 r0"


class Engine:
    """A TP rank's engine buffer: vLLM's CPU layout, one allocation, layer views."""

    def __init__(self, m: Model, tp: int, num_blocks: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        shape = (m.layers, num_blocks, m.heads // tp, m.block, 2 * m.head)
        self.store = torch.randn(shape, generator=g).to(m.dtype)  # also faults every page in
        self.kv = {f"model.layers.{i}.self_attn": self.store[i] for i in range(m.layers)}
        self.num_blocks = num_blocks

    def check(self, a: list[int], b: list[int]) -> None:
        """Engine blocks `b` hold the bits of blocks `a` (the round trip)."""
        bits = self.store.view(torch.int16 if self.store.element_size() == 2 else torch.int32)
        assert torch.equal(bits[:, a], bits[:, b]), "loaded blocks differ from the stored ones"


def open_cache(kind: str, block_bytes: int, blocks: int, root: Path, name: str) -> TierCache:
    tier: dict[str, object] = {"kind": kind, "blocks": blocks}
    if kind != "cpu":
        (root / name).mkdir(exist_ok=True)  # one store per model and variant
        tier["path"] = str(root / name / kind)
    return TierCache.open({"tiers": [tier]}, block_bytes=block_bytes)


def run_jobs(worker: OffloadingWorker, specs: list, job: list[int]) -> None:
    """Submit `specs` in order, wait for all; every job must succeed."""
    first = job[0]
    for spec in specs:
        assert worker.transfer_async(job[0], spec)
        job[0] += 1
    ids = range(first, job[0])
    assert not worker.wait(ids, timeout=600)
    done = worker.get_finished()
    assert len(done) == len(ids) and all(r.success for r in done), done


def edge(v: Variant, block_keys: list[bytes], ids: list[int]) -> tuple[list[bytes], list[int]]:
    """The cache's keys and the transfer engine's blocks of `block_keys` and engine `ids`, as
    the KV connector's worker maps them (`KVWorker._edge`): shards, or the blocks as they are."""
    hs = v.shards
    return (hs.keys(block_keys), hs.units(ids)) if hs else (block_keys, ids)


def store(v: Variant, block_keys: list[bytes], ids: list[int], job: list[int]) -> float:
    assert v.cache is not None and v.worker is not None
    manager = v.cache.manager
    t0 = time.perf_counter()
    keys, units = edge(v, block_keys, ids)
    plan = manager.prepare_store(keys)
    assert plan is not None and len(plan.stored_keys) == len(keys)
    run_jobs(v.worker, store_transfers(plan, keys, units), job)
    manager.complete_store(keys)
    return time.perf_counter() - t0


def load(v: Variant, block_keys: list[bytes], ids: list[int], job: list[int]) -> float:
    assert v.cache is not None and v.worker is not None
    manager = v.cache.manager
    t0 = time.perf_counter()
    keys, units = edge(v, block_keys, ids)
    spec = manager.prepare_load(keys)
    run_jobs(v.worker, load_transfers(spec, units), job)
    manager.complete_load(keys)
    return time.perf_counter() - t0


def variants(m: Model) -> list[Variant]:
    top = default_shards(m.heads)
    out = [Variant("whole TP=1", 1, None), Variant(f"S={top} TP=1", 1, HeadShards(top))]
    if m.heads % 2 == 0:
        out.insert(1, Variant("whole TP=2 r0", 2, None))
        out.append(Variant(f"S={top} TP=2 r0", 2, HeadShards(top, 2, 0)))
        if top != 2:
            out.append(Variant("S=2 TP=1", 1, HeadShards(2)))
    return out


def bench(m: Model, kind: str, args: argparse.Namespace, root: Path) -> None:
    n = args.blocks * args.jobs  # blocks per run
    num_blocks = 2 * n  # stores read the first half (at random ids), loads fill the other
    engines = {tp: Engine(m, tp, num_blocks, seed=tp) for tp in (1, 2) if m.heads % tp == 0}
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)).tolist()
    store_ids, load_ids = perm[:n], perm[n:]
    vs = variants(m)
    for v in vs:
        e = engines[v.tp]
        if v.shards is None:
            layout = KVLayout(e.kv, num_blocks)
        else:
            views = v.shards.unit_views(e.kv, num_blocks, m.heads // v.tp)
            layout = KVLayout(views, num_blocks * v.shards.local)
        local = v.shards.local if v.shards else 1
        v.cache = open_cache(kind, layout.block_bytes, n * local, root, f"{m.name}_{v.name}")
        v.worker = build_worker(layout, v.cache.tiers)
    b, tok = args.blocks, args.blocks * m.block
    times: dict[str, dict[str, list[float]]] = {v.name: {"store": [], "load": []} for v in vs}
    job = [0]
    try:
        for run in range(args.runs + 1):  # run 0 warms up and is dropped
            chain = list(range(run * n * m.block, (run + 1) * n * m.block))
            block_keys = prefix_hashes(chain, m.block, namespace="bench/tp-layout")
            st = dict.fromkeys((v.name for v in vs), 0.0)
            ld = dict.fromkeys((v.name for v in vs), 0.0)
            for j in range(args.jobs):
                keys, a, z = (x[j * b : (j + 1) * b] for x in (block_keys, store_ids, load_ids))
                for i in range(len(vs)):  # interleaved job by job, in a rotated order
                    v = vs[(i + j + run) % len(vs)]
                    st[v.name] += store(v, keys, a, job)
                    ld[v.name] += load(v, keys, z, job)
                    e = engines[v.tp]
                    e.check(a, z)
                    e.store[:, z] = 0  # the next variant must load its own bytes
            for v in vs:
                assert v.cache is not None
                hs = v.shards
                v.cache.manager.discard(hs.keys(block_keys) if hs else block_keys)
                if run:
                    times[v.name]["store"].append(st[v.name] / (args.jobs * tok) * 1e6)
                    times[v.name]["load"].append(ld[v.name] / (args.jobs * tok) * 1e6)
    finally:
        for v in vs:
            if v.worker is not None:
                v.worker.close()
            if v.cache is not None:
                v.cache.close()
    report(m, kind, vs, times)


def fmt(xs: list[float], spec: str) -> str:
    return "[" + " ".join(format(x, spec) for x in xs) + "]"


def report(
    m: Model, kind: str, vs: list[Variant], times: dict[str, dict[str, list[float]]]
) -> None:
    for v in vs:
        keys = v.shards.local if v.shards else 1
        line = f"{kind:5} {m.name} {v.name:14} {keys} key(s)/block"
        for op in ("store", "load"):
            t = times[v.name][op]
            line += f"  {op} {statistics.median(t):7.3f} us/token {fmt(t, '.3f')}"
        print(line)
    for v in vs:
        if v.shards is None:
            continue
        for op in ("store", "load"):
            mine, base = times[v.name][op], times[v.baseline][op]
            ratios = [a / b for a, b in zip(mine, base, strict=True)]
            print(
                f"RATIO {op:5} {kind} {m.name} {v.name} / {v.baseline} = "
                f"{statistics.median(ratios):.3f} {fmt(ratios, '.3f')}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="large,tiny", help="comma-separated: large, tiny, ttft")
    p.add_argument("--tiers", default="cpu,nvme,lmdb", help="comma-separated: cpu, nvme, lmdb")
    p.add_argument("--blocks", type=int, default=8, help="blocks per job")
    p.add_argument("--jobs", type=int, default=4, help="jobs per run (each waited for alone)")
    p.add_argument("--runs", type=int, default=7, help="timed runs (median)")
    p.add_argument("--tiny-heads", type=int, default=4, help="KV heads of the tiny model")
    p.add_argument("--dir", default=None, help="where NVMe and LMDB files go (default: a temp dir)")
    args = p.parse_args()
    models = {
        "large": Model("large", 16, 8, 128, 32, torch.bfloat16),
        "tiny": Model("tiny", 2, args.tiny_heads, 32, 32, torch.float32),
        "ttft": Model("ttft", 6, 4, 64, 32, torch.float32),
    }
    # As bench_transfer: copies on one thread (the lanes and the engine thread run alike).
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-tp-layout-", dir=args.dir))
    try:
        for name in args.models.split(","):
            m = models[name]
            print(
                f"# {name}: {m.layers} layers, {m.heads} KV heads x {m.head}, block {m.block} "
                f"tokens, {str(m.dtype).removeprefix('torch.')}: {m.block_bytes(1) // 1024} KiB "
                f"per block at TP=1; {args.jobs} jobs x {args.blocks} blocks per run, median "
                f"of {args.runs} runs, us per token (job submitted -> result, keys included)"
            )
            for kind in args.tiers.split(","):
                bench(m, kind, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
