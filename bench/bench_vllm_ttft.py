"""Time to first token on a real vLLM CPU engine: prefix hits from each tier vs recompute.

The model is a random-weight Llama of realistic shape written locally (`write_tiny_llama`
with 6 layers, hidden 512, 8 heads, 4 KV heads, head_dim 64, fp32), prompts are `--prompts`
random prompts of `--len` tokens (default 8 x 2,048), block size 32. Every request is sent
alone with ``max_tokens=1``, so its wall time is its TTFT. Each engine runs in a fresh,
in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) interpreter, and each process's first request
is left out of its figures (it carries a one-off warm-up of about 2 s in every mode).

One round is six processes, each on its own store (a round's stores are new):
1. `baseline`, no connector: set A (recompute), then set A again in the same engine (vLLM's
   own prefix-cache hit: the floor).
2. `default`, TierCacheConnector with the default configuration (CPU tier, then NVMe written
   through): set A (every request a miss, every block stored: the no-reuse overhead against
   1.), vLLM's prefix cache reset, set A again (hits from the CPU tier, same process, while
   the write-through of the misses' blocks to NVMe still runs beside them), reset, set A
   again once that write-through has run (`settle_through`: the hits alone), then set A once
   more (vLLM's own prefix-cache hits in this engine: the floor the CPU tier's hits are held
   to, as the issue defines it, "the same prompts again in the same engine"; fresh engine
   processes differ by up to ~15 % in their own compute, so a floor from process 1 would add
   that spread to the ratio).
3. `nvme`, a fresh process on 2.'s tiers: set A (hits from NVMe).
4. `populate`, CPU + LMDB + Redis, both written through: sets A and B (not timed).
5. `lmdb`, a fresh process, CPU + LMDB: set A (hits from LMDB).
6. `redis`, a fresh process, CPU + Redis, ``[deadlines] load_timeout = --load-timeout``:
   set A (hits from Redis), then set B with the redis-server SIGSTOPped for exactly that set
   (time to a result with a hung Redis; SIGCONT after it).
Processes 1 and 2 swap places from round to round, so neither drift nor position favours one.
`--compare PATH` adds processes 2 and 3 once more per round, importing tiercache (with its
`tiers` and `policies`, through a tree of links: `compare_tree`) from PATH (another revision's
checkout), each in rotation with this tree's: an A/B of the overhead and of NVMe hits within
one run, each revision on its own store. `--overhead` runs processes 1 and 2 only, `--nvme`
processes 1 to 3.

The raw read time is the bytes a hit loads per request (`num_cached_tokens` / 32 blocks of
layers x 32 x 4 x 64 x 2 x 4 bytes) at this disk's O_DIRECT read rate, measured here with
`bench_nvme.Raw` (4 threads, 32-block batches, cold reads of 4 requests' worth). The one copy
is the same bytes at this machine's memcpy rate (`copy_rate`: one torch copy between host
buffers), measured before and after the rounds too. Targets: issue 35, NVMe hits <= 1.1 x
(floor + raw read), CPU-tier hits <= 1.1 x (the floor of their own engine, process 2, + one
copy); issue 16, CPU-tier hits <= 1.2 x that floor; issue 23, no-reuse overhead of the
default configuration < 3 %.

The overhead is also given in process CPU time (all threads of the in-process engine, the
write-through thread's copies included): on a shared machine it moves less with other jobs
than wall time does. Ratios are taken within a round, then the median over rounds is printed
with each round's value. Outputs (one greedy token per request) are compared with the baseline's.

Run: .venv-vllm/bin/python bench/bench_vllm_ttft.py [--rounds 3] [--prompts 8] [--len 2048]
     [--load-timeout 1.0] [--quick] [--overhead] [--nvme] [--compare PATH] [--json PATH]
     [--tp-layout rank] [--no-startup]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import mmap
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _child import child_json

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"layers": 6, "hidden": 512, "heads": 8, "kv_heads": 4, "head_dim": 64}
MODEL = {**SHAPE, "intermediate": 1536, "dtype": "float32", "max_positions": 4096}
BLOCK = 32


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def block_bytes() -> int:
    """Bytes of one block of KV (all layers, K and V, fp32)."""
    return SHAPE["layers"] * BLOCK * SHAPE["kv_heads"] * SHAPE["head_dim"] * 2 * 4


TP_LAYOUT: list[str] = []  # --tp-layout: kv_connector_extra_config's tp_layout, if given


def connector(tiers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    layout = {"tp_layout": TP_LAYOUT[0]} if TP_LAYOUT else {}
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": {"tiers": tiers, **extra}, **layout},
    }


def raw_read_rate(work: Path, nvme: ModuleType, blocks: int, runs: int = 5) -> float:
    """This disk's cold O_DIRECT read rate in bytes/s (median of `runs`), as the NVMe tier
    reads: `blocks` slots of `block_bytes()` rounded to 4 KiB, 4 threads, 32-block batches.
    Each run reads slots of its own, once, as a hit reads what it loads: reading one region
    again measured the VM host's cache (up to 4 GB/s "after" a run at 1.3 GB/s)."""
    slot = -(-block_bytes() // 4096) * 4096
    total = blocks * runs
    images = mmap.mmap(-1, total * slot)
    images.write(os.urandom(total * slot))
    raw = nvme.Raw(str(work / "raw.bin"), images, slot, total, threads=4, direct=True)
    try:
        every = [list(range(i, min(i + 32, total))) for i in range(0, total, 32)]
        raw.write(every)
        times = []
        for r in range(runs):
            lo, hi = r * blocks, (r + 1) * blocks
            batches = [list(range(i, min(i + 32, hi))) for i in range(lo, hi, 32)]
            t0 = time.perf_counter()
            raw.read(batches)
            times.append(time.perf_counter() - t0)
        return blocks * slot / statistics.median(times)
    finally:
        raw.close()
        images.close()


def copy_rate(nbytes: int, runs: int = 7) -> float:
    """This machine's memcpy rate in bytes/s (median of `runs`): one copy of `nbytes` between
    two host buffers, as a CPU-tier hit's one copy (issue 35: the floor plus one copy); the
    demo's own measure (`tiercache.cli.demo.memcpy_gbps`)."""
    from tiercache.cli.demo import memcpy_gbps

    return memcpy_gbps(nbytes, runs) * 1e9


def compare_tree(path: str, work: Path) -> str:
    """A directory to put on PYTHONPATH so that `tiercache` and its root-level packages
    (`tiers/`, `policies/`, installed as `tiercache.tiers` / `tiercache.policies`) all come
    from the checkout at `path`: `tiercache` alone on PYTHONPATH would take those two from
    this tree's editable install."""
    src = Path(path).resolve()
    shim = work / "compare-tree" / "tiercache"
    shim.mkdir(parents=True)
    for entry in (src / "tiercache").iterdir():
        (shim / entry.name).symlink_to(entry)
    for pkg in ("tiers", "policies"):
        if (src / pkg).is_dir() and not (shim / pkg).exists():
            (shim / pkg).symlink_to(src / pkg)
    return str(shim.parent)


@contextlib.contextmanager
def pythonpath(path: str | None) -> Iterator[None]:
    """PYTHONPATH set to `path` (None: unchanged) for the engines started inside."""
    old = os.environ.get("PYTHONPATH")
    if path is not None:  # the engine and vLLM's workers import tiercache from there
        os.environ["PYTHONPATH"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _p90(xs: list[float]) -> float:
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


def _rounds(xs: list[float]) -> str:
    med = statistics.median(xs)
    return f"{med:.3f} (rounds: {', '.join(f'{x:.3f}' for x in xs)})"


def one_round(
    eng: ModuleType, model: Path, work: Path, rnd: int, args: argparse.Namespace, redis: Any
) -> dict[str, Any]:
    """Run the six processes of one round; per-request times (first request of each process
    left out) and outputs by mode."""
    url, proc = redis
    a = eng.make_prompts(args.prompts, args.len, seed=1000 * rnd)
    b = eng.make_prompts(args.prompts, args.len, seed=1000 * rnd + 1)
    # A batch of new prompts, 16 tokens each: the no-reuse overhead on batched serving.
    c = {"prompts": eng.make_prompts(args.prompts, args.len, seed=1000 * rnd + 2), "max_tokens": 16}
    one = {"max_tokens": 1, "one_by_one": True}
    base = {"model": str(model), "dtype": "float32", "max_model_len": args.len + 64}
    nvme_tiers = [
        {"kind": "cpu", "capacity": "512MiB"},
        {"kind": "nvme", "path": str(work / "nvme"), "capacity": "512MiB"},
    ]
    lmdb = {"kind": "lmdb", "path": str(work / "lmdb"), "capacity": "512MiB"}
    rtier = {"kind": "redis", "url": url, "prefix": f"ttft{rnd}:", "capacity": "512MiB"}
    out: dict[str, Any] = {}

    def run(name: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        r = eng.run_in_subprocess({**base, **spec}, timeout=900)
        print(f"  round {rnd} {name:9s} {time.perf_counter() - t0:5.1f} s", flush=True)
        out[f"{name}_stores"] = r["stores"]
        out[f"{name}_init"] = [r["init_s"]]  # LLM() start-up, the tiers' open included
        return r["batches"]

    def baseline() -> None:
        # The same KV cache manager as with a connector (vLLM turns the hybrid one off for it).
        first, again, batch = run(
            "baseline",
            {
                "batches": [{"prompts": a, **one}, {"prompts": a, **one}, c],
                "disable_hybrid_kv_cache_manager": True,
            },
        )
        out["recompute"] = first["request_s"][1:]
        out["cpu_recompute"] = first["request_cpu_s"][1:]
        out["cpu_batch_recompute"] = [batch["cpu_s"]]
        out["batch_recompute"] = [batch["wall_s"]]
        out["floor"] = again["request_s"]
        out["outputs"] = first["outputs"]
        out["floor_outputs"] = again["outputs"]

    def tiers_of(tag: str) -> list[dict[str, Any]]:
        return (
            nvme_tiers if not tag else [nvme_tiers[0], {**nvme_tiers[1], "path": str(work / tag)}]
        )

    def default(tag: str = "", path: str | None = None) -> None:
        with pythonpath(path):
            first, busy, again, floor_here, batch = run(
                tag or "default",
                {
                    "kv_transfer_config": connector(tiers_of(tag)),
                    "batches": [
                        {"prompts": a, **one, "reset_prefix_cache": True},
                        # CPU-tier hits right after the misses: the write-through of their
                        # blocks to NVMe (~25 MB a request) still runs beside them ...
                        {"prompts": a, **one, "reset_prefix_cache": True},
                        # ... and once it has run: the hits alone, as the floor is measured
                        {"prompts": a, **one, "settle_through": True},
                        {"prompts": a, **one},  # vLLM's own prefix-cache hits, this engine
                        c,
                    ],
                },
            )
        out[tag + "batch_miss"] = [batch["wall_s"]]
        # tiercache's own share of the CPU of the no-reuse set: its store copies and
        # write-through threads (over this set and the next two, which store nothing, so the
        # last request's copies are in, and the settling before the third) and its methods
        # on the engine's thread.
        ours = sum(
            v
            for b in (first, busy, again)
            for k, v in b["thread_cpu_s"].items()
            if k.startswith(
                ("tiercache-write-through", "tiercache-xfer-copy-store", "tiercache-nvme")
            )
        )
        out["share_" + tag + "miss"] = [(ours + first["connector_s"]) / first["cpu_s"]]
        out[tag + "miss"] = first["request_s"][1:]
        out["cpu_" + tag + "miss"] = first["request_cpu_s"][1:]
        out["cpu_" + tag + "batch_miss"] = [batch["cpu_s"]]
        out[tag + "cpu_busy"] = busy["request_s"]
        out[tag + "cpu_busy_outputs"] = busy["outputs"]
        out[tag + "cpu"] = again["request_s"]
        out[tag + "cpu_outputs"] = again["outputs"]
        out[tag + "cpu_cached"] = again["num_cached_tokens"]
        out[tag + "floor_here"] = floor_here["request_s"]
        out[tag + "floor_here_outputs"] = floor_here["outputs"]
        out[tag + "floor_here_cached"] = floor_here["num_cached_tokens"]

    def nvme(tag: str = "", path: str | None = None) -> None:
        # A fresh process on process 2's tiers (the --compare revision: on its own store).
        with pythonpath(path):
            (hits,) = run(
                tag + "nvme",
                {
                    "kv_transfer_config": connector(tiers_of(tag)),
                    "batches": [{"prompts": a, **one}],
                },
            )
        out[tag + "nvme"], out[tag + "nvme_outputs"] = hits["request_s"][1:], hits["outputs"]
        out[tag + "nvme_cached"] = hits["num_cached_tokens"]

    compare = compare_tree(args.compare, work) if args.compare else None
    steps = [baseline, default]
    if compare:
        steps.append(lambda: default("compare_", compare))
    for step in steps[rnd % len(steps) :] + steps[: rnd % len(steps)]:
        step()
    if args.overhead:
        return out
    # With --compare, the two trees' NVMe processes swap places from round to round.
    hit_steps = [nvme, lambda: nvme("compare_", compare)] if compare else [nvme]
    for step in hit_steps[rnd % len(hit_steps) :] + hit_steps[: rnd % len(hit_steps)]:
        step()
    if args.nvme:
        return out
    through = {"write_policy": "write-through"}
    (populated,) = run(
        "populate",
        {
            "kv_transfer_config": connector(
                [{"kind": "cpu", "capacity": "512MiB"}, {**lmdb, **through}, {**rtier, **through}]
            ),
            "batches": [{"prompts": a + b, "max_tokens": 1}],
        },
    )
    (hits,) = run(
        "lmdb",
        {
            "kv_transfer_config": connector([{"kind": "cpu", "capacity": "512MiB"}, lmdb]),
            "batches": [{"prompts": a, **one}],
        },
    )
    out["lmdb"], out["lmdb_outputs"] = hits["request_s"][1:], hits["outputs"]
    out["lmdb_cached"] = hits["num_cached_tokens"]
    deadlines = {"deadlines": {"load_timeout": args.load_timeout}}
    hits, hung = run(
        "redis",
        {
            "kv_transfer_config": connector(
                [{"kind": "cpu", "capacity": "512MiB"}, rtier], **deadlines
            ),
            "batches": [{"prompts": a, **one}, {"prompts": b, **one, "stop_pid": proc.pid}],
        },
    )
    out["redis"], out["redis_outputs"] = hits["request_s"][1:], hits["outputs"]
    out["redis_cached"] = hits["num_cached_tokens"]
    out["hung"], out["hung_outputs"] = hung["request_s"], hung["outputs"]
    out["hung_cached"] = hung["num_cached_tokens"]
    out["hung_expected"] = populated["outputs"][len(a) :]
    return out


OPEN_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from tiercache import TierCache
t1 = time.perf_counter()
cache = TierCache.open(json.loads(sys.argv[1]), block_bytes=int(sys.argv[2]))
t2 = time.perf_counter()
cache.close()
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1}))
"""


def startup(work: Path) -> dict[str, list[float]]:
    """Seconds `TierCache.open` takes in a fresh process (issue 16, item 5): the benchmark's
    tiers (CPU 512 MiB, NVMe 512 MiB) against the issue's large ones (CPU 2 GiB, NVMe 8 GiB,
    LMDB 8 GiB), each opened first (files made, space reserved) and then again (reopen)."""
    sizes = {"small": ("512MiB", "512MiB", "512MiB"), "large": ("2GiB", "8GiB", "8GiB")}
    out: dict[str, list[float]] = {}
    for name, (cpu, disk, lmdb) in sizes.items():
        root = work / f"startup-{name}"
        root.mkdir()
        config = {
            "namespace": "startup",
            "tiers": [
                {"kind": "cpu", "capacity": cpu},
                {"kind": "nvme", "path": str(root / "nvme"), "capacity": disk},
                {"kind": "lmdb", "path": str(root / "lmdb"), "capacity": lmdb},
            ],
        }
        for when in ("first", "reopen"):
            got = child_json(
                [sys.executable, "-c", OPEN_CHILD, json.dumps(config), str(block_bytes())],
                what=f"the {when} open of the {name} tiers",
            )
            out[f"{name}_{when}"] = [got["open_s"]]
        shutil.rmtree(root)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--len", type=int, default=2048)
    ap.add_argument("--load-timeout", type=float, default=1.0)
    ap.add_argument("--dir", help="directory for the model and stores (default: under /tmp)")
    ap.add_argument("--quick", action="store_true", help="1 round of 5 prompts")
    ap.add_argument(
        "--tp-layout",
        choices=("auto", "heads", "rank"),
        help="the connector's tp_layout (default: its default, head shards here): 'rank' "
        "measures whole blocks, one key each, as before head shards (issue 32)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write every round's raw figures there")
    ap.add_argument(
        "--compare",
        metavar="PATH",
        help="also run process 2 with tiercache imported from PATH (a checkout of another "
        "revision), in the same rotation: its rows are marked 'compare'",
    )
    ap.add_argument(
        "--overhead", action="store_true", help="only processes 1 and 2 (recompute, misses, floor)"
    )
    ap.add_argument(
        "--nvme",
        action="store_true",
        help="only processes 1 to 3 (and --compare's 2 and 3): no LMDB, no Redis",
    )
    ap.add_argument(
        "--no-startup",
        action="store_true",
        help="skip the start-up timing (its large tiers reserve 16 GiB of disk for a moment)",
    )
    args = ap.parse_args()
    if args.tp_layout:
        TP_LAYOUT.append(args.tp_layout)
    if args.quick:
        args.rounds, args.prompts = 1, 5
    if args.prompts < 3:
        ap.error("--prompts: at least 3 (each process's first request is left out)")
    eng = _load("tc_engine", ROOT / "tests/vllm/engine.py")
    nvme = _load("tc_bench_nvme", ROOT / "bench/bench_nvme.py")
    bredis = _load("tc_bench_redis", ROOT / "bench/bench_redis.py")
    rounds: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tc-bench-ttft-", dir=args.dir) as tmp:
        model = eng.write_tiny_llama(Path(tmp) / "model", **MODEL)
        rate = raw_read_rate(Path(tmp), nvme, blocks=4 * (args.len // BLOCK))
        copy = [copy_rate(args.len // BLOCK * block_bytes())]
        opens = None if args.no_startup else startup(Path(tmp))
        with bredis.redis_server() as redis:
            for rnd in range(args.rounds):
                work = Path(tmp) / f"round{rnd}"
                work.mkdir()
                rounds.append(one_round(eng, model, work, rnd, args, redis))
                shutil.rmtree(work)  # the next round's stores need the room
                if args.json:  # kept round by round: a later failure loses only its round
                    Path(args.json).write_text(json.dumps({"rate": [rate], "rounds": rounds}))
            os.kill(redis[1].pid, signal.SIGCONT)  # in case a run died while it was stopped
        rate_after = raw_read_rate(Path(tmp), nvme, blocks=4 * (args.len // BLOCK))
        copy.append(copy_rate(args.len // BLOCK * block_bytes()))
    if args.json:
        out = {"rate": [rate, rate_after], "copy_rate": copy, "rounds": rounds}
        Path(args.json).write_text(json.dumps(out))
    report(rounds, args, rate, rate_after, time.perf_counter() - t_start, copy)
    if opens is not None:
        print(
            "\nstart-up (issue 16, item 5): TierCache.open in a fresh process, CPU + NVMe + LMDB; "
            + "; ".join(
                f"{size} ({'2 + 8 + 8 GiB' if size == 'large' else '3 x 512 MiB'}): first "
                f"{opens[size + '_first'][0]:.3f} s, reopen {opens[size + '_reopen'][0]:.3f} s"
                for size in ("small", "large")
            )
        )
    inits = {
        k[: -len("_init")]: statistics.median(r[k][0] for r in rounds)
        for k in rounds[0]
        if k.endswith("_init")
    }
    if "baseline" in inits:
        print(
            "LLM() start-up, median over rounds: "
            + ", ".join(
                f"{k} {v:.2f} s" + (f" ({v - inits['baseline']:+.2f})" if k != "baseline" else "")
                for k, v in inits.items()
            )
        )
    return 0


def report(
    rounds: list[dict[str, Any]],
    args: argparse.Namespace,
    rate: float,
    rate_after: float,
    elapsed: float,
    copy: list[float],
) -> None:
    disk = statistics.median([rate, rate_after])
    cached = statistics.median(c for r in rounds for c in r.get("nvme_cached", r["cpu_cached"]))
    read_bytes = cached // BLOCK * block_bytes()
    raw_s = read_bytes / disk
    copy_s = read_bytes / statistics.median(copy)  # a CPU-tier hit's one copy
    print(
        f"\n{len(rounds)} rounds, {args.prompts} prompts x {args.len} tokens -> 1 token, one "
        f"request at a time, in-process engines, 6-layer fp32 Llama (hidden 512), block {BLOCK};"
        f" {elapsed:.0f} s in all"
    )
    print(
        f"each hit loads {cached} tokens = {read_bytes / 1e6:.1f} MB; disk O_DIRECT read "
        f"{rate / 1e9:.2f} / {rate_after / 1e9:.2f} GB/s (before / after): raw read "
        f"{raw_s * 1e3:.1f} ms per request; memcpy "
        + " / ".join(f"{c / 1e9:.2f}" for c in copy)
        + f" GB/s (before / after): one copy {copy_s * 1e3:.1f} ms per request"
    )
    modes = [
        ("recompute (no connector)", "recompute"),
        ("tiercache miss, default config (no reuse)", "miss"),
        ("the same, --compare revision", "compare_miss"),
        ("vLLM prefix-cache hit (floor)", "floor"),
        ("vLLM prefix-cache hit in the CPU tier's engine (floor, same process)", "floor_here"),
        ("tiercache CPU tier, same process, the misses' write-through still running", "cpu_busy"),
        ("tiercache CPU tier, same process (write-through settled)", "cpu"),
        ("the same, --compare revision", "compare_cpu"),
        ("tiercache NVMe, fresh process", "nvme"),
        ("the same, --compare revision", "compare_nvme"),
        ("tiercache LMDB, fresh process", "lmdb"),
        ("tiercache Redis, fresh process", "redis"),
        ("batch of all prompts, 16 tokens each, no connector (wall time)", "batch_recompute"),
        ("the same with the default config, no reuse (wall time, / the row above)", "batch_miss"),
        ("the same, --compare revision", "compare_batch_miss"),
        (f"Redis SIGSTOPped, load_timeout {args.load_timeout:g} s", "hung"),
    ]

    print("\n| mode | median TTFT | p90 | median / recompute (rounds) |")
    ref_of = {k: "batch_recompute" for k in ("batch_recompute", "batch_miss", "compare_batch_miss")}
    print("|---|---|---|---|")
    for label, key in modes:
        if key not in rounds[0]:
            continue
        xs = [x for r in rounds for x in r[key]]
        ref = ref_of.get(key, "recompute")
        per_round = [_med(r[key]) / _med(r[ref]) for r in rounds]
        print(
            f"| {label} | {_med(xs) * 1e3:.0f} ms | {_p90(xs) * 1e3:.0f} ms |"
            f" {_rounds(per_round)} |"
        )
    if "hung" in rounds[0]:
        # Each round's slowest request against that round's load_timeout + recompute (the
        # median recompute of the round's no-connector process: engines differ by round).
        pairs = [(max(r["hung"]), args.load_timeout + _med(r["recompute"])) for r in rounds]
        print(
            "\nhung Redis, slowest request / (load_timeout + recompute) per round: "
            + ", ".join(f"{x:.2f} / {b:.2f} s" for x, b in pairs)
            + f"; within the bound in {sum(x <= b for x, b in pairs)} of {len(rounds)} rounds"
        )
        for r in rounds:
            for store in r["redis_stores"].values():
                c, st = store["counters"], store["stats"].get("redis", {})
                picked = {k: v for k, v in c.items() if "deadline" in k or "error" in k}
                print(
                    f"  redis process: {picked}, suspensions {st.get('suspensions')}, "
                    f"suspended_ms {st.get('suspended_ms')}, errors {st.get('errors')}"
                )
    print()
    floor = lambda r: _med(r["floor"])  # noqa: E731
    recompute, batch = (lambda r: _med(r["recompute"])), (lambda r: r["batch_recompute"][0])
    cpu_ref = (lambda r: _med(r["cpu_recompute"]), lambda r: r["cpu_batch_recompute"][0])
    targets = []
    for tag in ("", "compare_"):  # this tree, then the --compare revision
        name = "compare: " if tag else ""
        targets += [
            (f"{name}miss/recompute (issue 23 overhead)", tag + "miss", recompute, "< 1.03"),
            (f"{name}batch miss/recompute (same, batched)", tag + "batch_miss", batch, "< 1.03"),
            (
                f"{name}cpu/floor (the floor of the same engine)",
                tag + "cpu",
                lambda r, t=tag: _med(r[t + "floor_here"]),
                "<= 1.2",
            ),
            (f"{name}cpu/floor (the no-connector engine's floor)", tag + "cpu", floor, "report"),
            (
                f"{name}cpu while the write-through runs/floor (the same engine's)",
                tag + "cpu_busy",
                lambda r, t=tag: _med(r[t + "floor_here"]),
                "report",
            ),
        ]
        targets.append(
            (
                f"{name}cpu/(floor+one copy) (issue 35; the floor of the same engine)",
                tag + "cpu",
                lambda r, t=tag: _med(r[t + "floor_here"]) + copy_s,
                "<= 1.1",
            )
        )
        targets += [
            (f"{name}CPU time: miss/recompute", f"cpu_{tag}miss", cpu_ref[0], "report"),
            (f"{name}CPU time: batch/recompute", f"cpu_{tag}batch_miss", cpu_ref[1], "report"),
        ]
    targets += [
        ("nvme/(floor+raw read)", "nvme", lambda r: floor(r) + raw_s, "<= 1.1 (issue 35)"),
        (
            "compare: nvme/(floor+raw read)",
            "compare_nvme",
            lambda r: floor(r) + raw_s,
            "<= 1.1 (issue 35)",
        ),
        ("lmdb/(floor+raw read)", "lmdb", lambda r: floor(r) + raw_s, "report"),
        ("redis/floor", "redis", floor, "report"),
    ]
    if args.compare:
        targets += [
            ("miss/compare miss", "miss", lambda r: _med(r["compare_miss"]), "report"),
            ("batch/compare batch", "batch_miss", lambda r: r["compare_batch_miss"][0], "report"),
        ]
        if "compare_nvme" in rounds[0]:
            targets.append(
                ("nvme/compare nvme", "nvme", lambda r: _med(r["compare_nvme"]), "report")
            )
    for tag in ("", "compare_"):
        if "share_" + tag + "miss" in rounds[0]:
            xs = [r["share_" + tag + "miss"][0] for r in rounds]
            print(
                f"SHARE {'compare: ' if tag else ''}tiercache's threads and methods, of the "
                f"process CPU time of the no-reuse set: {_rounds(xs)}"
            )
    for name, key, ref, goal in targets:
        if key in rounds[0]:
            xs = [_med(r[key]) / ref(r) for r in rounds]
            print(f"RATIO {name} {_rounds(xs)}  target {goal}")
    for key in (
        *("floor", "floor_here", "cpu_busy", "cpu", "compare_cpu"),
        *("nvme", "compare_nvme", "lmdb", "redis", "hung"),
    ):
        if f"{key}_outputs" not in rounds[0]:
            continue
        ref = "hung_expected" if key == "hung" else "outputs"
        pairs = [(x, y) for r in rounds for x, y in zip(r[f"{key}_outputs"], r[ref], strict=True)]
        print(f"outputs equal to recompute, {key}: {sum(x == y for x, y in pairs)} of {len(pairs)}")
    print(
        "hit tokens per request (median): "
        + ", ".join(
            f"{k} {statistics.median(c for r in rounds for c in r[f'{k}_cached'])}"
            for k in ("cpu", "floor_here", "nvme", "compare_nvme", "lmdb", "redis", "hung")
            if f"{k}_cached" in rounds[0]
        )
    )


if __name__ == "__main__":
    sys.exit(main())
