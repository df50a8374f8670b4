"""The benchmark harness behind `tiercache bench`.

- `traces`: seeded synthetic traces (chat, rag, agentic, scan) and a JSONL loader.
- `belady`: Belady's optimal offline policy, the hit-rate ceiling.
- `replay`: a trace through tiercache's manager, vLLM's manager, or a whole TierCache.
- `baselines`: same-run baselines (sha256 chain, memcpy, O_DIRECT, raw py-lmdb).
- `runner`: `run_bench(BenchOptions) -> BenchReport`; `report`: markdown, PNG plot, JSON.
"""

from tiercache.benchharness.belady import BeladyResult, belady
from tiercache.benchharness.runner import BenchOptions, BenchReport, run_bench
from tiercache.benchharness.traces import Trace, TraceError, load_jsonl, make_trace

__all__ = [
    "BeladyResult",
    "BenchOptions",
    "BenchReport",
    "Trace",
    "TraceError",
    "belady",
    "load_jsonl",
    "make_trace",
    "run_bench",
]
