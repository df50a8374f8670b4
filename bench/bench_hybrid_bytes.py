"""Bytes per token each KV cache group stores, for a hybrid-attention model (issue 17).

A tiny random Gemma 3 (layers s s f s s f, sliding window `--window`, block size 32) on a
real vLLM CPU engine with `TierCacheConnector`, each run in a fresh process, prompts of each
`--lengths` in turn (new random tokens, so every block is stored):

- `hybrid`: vLLM's hybrid KV cache manager on (three KV cache groups; the connector declares
  `SupportsHMA`): full-attention groups keep every block, sliding-window groups the window
  before each prompt's end;
- `hma-off`: the same model with ``disable_hybrid_kv_cache_manager=True``: one group, every
  layer's blocks for every token, as before issue 17 (the baseline, same run).

Per prompt length it prints each group's bytes per token (the connector's `kv_groups`
telemetry section: blocks kept for the tokens stored, times bytes per block, over tokens; the
same figures `tiercache inspect` shows) and `RATIO hybrid/hma-off` (total bytes per token,
hybrid over baseline). The sliding-window groups' bytes per token fall as prompts grow (their
bytes per prompt stay bounded by the window); the full-attention group's stay flat. These are
counts, not timings: one round is exact.

Run: .venv-vllm/bin/python bench/bench_hybrid_bytes.py [--lengths 256,768,1920]
     [--prompts 2] [--window 64]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from bench_vllm_connector import load_engine

BS = 32


def _kv(engine: ModuleType, store: Path) -> dict[str, Any]:
    store.mkdir(parents=True, exist_ok=True)
    tiers = [
        {"kind": "cpu", "blocks": 64},
        {"kind": "lmdb", "path": str(store / "lmdb"), "capacity": "512MiB"},
    ]
    return engine.tiercache_kv({"namespace": "bytes", "tiers": tiers})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,768,1920")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--window", type=int, default=64)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    engine = load_engine()
    work = Path(tempfile.mkdtemp(prefix="tiercache-bench-bytes-"))
    model = engine.write_tiny_gemma3(work / "gemma", sliding_window=args.window)
    rng = random.Random(17)
    print(f"tiny Gemma 3 (s s f s s f), window {args.window}, block {BS}, {args.prompts} prompts")
    print(f"{'tokens':>7} {'mode':>8} {'group':>16} {'bytes/block':>12} {'bytes/token':>12}")
    ratios = []
    for n in lengths:
        prompts = [[rng.randrange(3, 4096) for _ in range(n + 5)] for _ in range(args.prompts)]
        totals = {}
        for mode in ("hma-off", "hybrid"):
            spec = {
                "model": str(model),
                "kv_transfer_config": _kv(engine, work / f"{mode}-{n}"),
                "batches": [{"prompts": prompts, "max_tokens": 1, "reset_prefix_cache": True}],
                "block_size": BS,
                "max_model_len": n + 64,
                **({"disable_hybrid_kv_cache_manager": True} if mode == "hma-off" else {}),
            }
            run = engine.run_in_subprocess(spec)
            (snap,) = run["stores"].values()
            groups = snap["sections"]["kv_groups"]["groups"]  # what `tiercache inspect` shows
            for g in groups:
                name = f"{g['group']}:{g['kind']}"
                bpt = g["bytes_per_token"]
                print(f"{n:>7} {mode:>8} {name:>16} {g['block_bytes']:>12} {bpt:>12.1f}")
            totals[mode] = sum(g["bytes_per_token"] for g in groups)
        ratios.append(totals["hybrid"] / totals["hma-off"])
        print(f"{n:>7} RATIO hybrid/hma-off bytes per token: {ratios[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
