"""TierCacheConnector overhead on a real vLLM CPU engine (tiny random-weight Llama).

Two configurations of the same engine, each in fresh processes (vLLM import ~12 s each):
- baseline: no KV connector;
- tiercache: `TierCacheConnector` with a CPU tier and an NVMe tier in a temporary directory.

Each process runs one warm-up batch, then `--batches` timed batches of `--prompts` prompts
of `--len` tokens, every batch new random tokens, so nothing hits (neither vLLM's prefix
cache nor tiercache): the connector hashes, looks up and saves every full block, which is its
whole cost when there are no hits. The processes alternate (baseline, tiercache, baseline,
...) `--rounds` times, so machine noise hits both. Prints the median batch wall time of each
configuration, each round's ratio of medians, and `RATIO tiercache/baseline`, the median of
the rounds' ratios (target < 1.10: under 10% overhead), and the same for process CPU time
(all threads). `SHARE connector/batch` is the time spent inside the connector's methods on
the engine thread divided by the same batch's wall time: measured inside one run, it is the
figure that other jobs on a shared machine disturb least.

With `--hits`, the tiercache processes also time the same batches again after resetting
vLLM's prefix cache (every prompt then loads its blocks from tiercache), for reference.

Run: /work/vllm-venv/bin/python bench/bench_vllm_connector.py [--rounds 2] [--batches 8]
     [--prompts 8] [--len 512] [--max-tokens 16] [--hits]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _engine() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tc_engine", ROOT / "tests/vllm/engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--hits", action="store_true")
    args = ap.parse_args()
    eng = _engine()
    walls: dict[str, list[float]] = {"baseline": [], "tiercache": []}
    cpus: dict[str, list[float]] = {"baseline": [], "tiercache": []}
    shares: list[float] = []  # connector time on the engine thread / batch wall, same batch
    round_ratios: list[float] = []
    hit_walls: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tc-bench-vllm-") as tmp:
        model = eng.write_tiny_llama(Path(tmp) / "model")
        for rnd in range(args.rounds):
            batches: list[dict[str, Any]] = [
                {
                    "prompts": eng.make_prompts(args.prompts, args.len, seed=1000 * rnd + b),
                    "max_tokens": args.max_tokens,
                }
                for b in range(args.batches + 1)  # batch 0 warms up
            ]
            for name in ("baseline", "tiercache"):
                spec: dict[str, Any] = {"model": str(model), "batches": list(batches)}
                if name == "tiercache":
                    store = Path(tmp) / f"store-{rnd}"
                    store.mkdir()
                    tiers = [
                        {"kind": "cpu", "capacity": "256MiB"},
                        {"kind": "nvme", "path": str(store / "nvme"), "capacity": "512MiB"},
                    ]
                    spec["kv_transfer_config"] = {
                        "kv_connector": "TierCacheConnector",
                        "kv_connector_module_path": "tiercache.connectors.vllm",
                        "kv_role": "kv_both",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"config": {"tiers": tiers}},
                    }
                    if args.hits:
                        spec["batches"][-1] = {**spec["batches"][-1], "reset_prefix_cache": True}
                        spec["batches"] += [dict(b) for b in batches[1:]]
                r = eng.run_in_subprocess(spec, timeout=900)
                timed = [b["wall_s"] for b in r["batches"][1 : args.batches + 1]]
                walls[name] += timed
                cpus[name] += [b["cpu_s"] for b in r["batches"][1 : args.batches + 1]]
                if name == "tiercache":
                    shares += [
                        b["connector_s"] / b["wall_s"] for b in r["batches"][1 : args.batches + 1]
                    ]
                    (store_stats,) = r["stores"].values()
                    c = store_stats["counters"]
                    assert c.get("lookup_hit_blocks", 0) == 0 or args.hits, c
                    if args.hits:
                        again = r["batches"][args.batches + 1 :]
                        hit_walls += [b["wall_s"] for b in again[1:]]
                        assert all(n > 0 for b in again for n in b["num_cached_tokens"]), (
                            "expected external hits on the repeated batches"
                        )
                print(
                    f"round {rnd} {name:9s}: median batch {statistics.median(timed) * 1e3:7.1f} ms"
                    f" (init {r['init_s']:.1f} s)",
                    flush=True,
                )
            n = args.batches
            round_ratios.append(
                statistics.median(walls["tiercache"][-n:])
                / statistics.median(walls["baseline"][-n:])
            )
    base = statistics.median(walls["baseline"])
    tc = statistics.median(walls["tiercache"])
    print(
        f"\n{args.prompts} prompts x {args.len} tokens -> {args.max_tokens} tokens, "
        f"{len(walls['baseline'])} batches per configuration"
    )
    print(f"baseline  median {base * 1e3:8.1f} ms")
    print(f"tiercache median {tc * 1e3:8.1f} ms  (no hits: hash, lookup, save every block)")
    print(f"ratio of the pooled medians {tc / base:.3f}")
    ratio = statistics.median(round_ratios)
    print(f"per-round ratios {', '.join(f'{x:.3f}' for x in round_ratios)}")
    print(
        f"RATIO tiercache/baseline {ratio:.3f}  "
        f"(overhead {100 * (ratio - 1):+.1f}%, median of the rounds)"
    )
    cpu = statistics.median(cpus["tiercache"]) / statistics.median(cpus["baseline"])
    print(
        f"RATIO cpu tiercache/baseline {cpu:.3f}  (process CPU time, all threads: robust "
        "when other jobs share the machine)"
    )
    share = statistics.median(shares)
    print(
        f"SHARE connector/batch {share:.3f}  (time inside the connector's methods on the "
        "engine thread over the same batch's wall time; machine noise cancels)"
    )
    if hit_walls:
        hit = statistics.median(hit_walls)
        print(f"tiercache, all prompts hit (prefix cache reset): median {hit * 1e3:8.1f} ms")
        print(f"RATIO hits/baseline {hit / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
