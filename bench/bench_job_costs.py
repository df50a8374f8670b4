"""Host cost of each CUDA call a one-block transfer job makes, on this machine (issue 34).

A decode-time store of one block should cost tens of microseconds of host time. This prints
the median host time per call (microseconds, `--calls` calls per run, medians of `--runs`)
of every piece a CUDA job is made of, so that the job's total can be read against its
parts: stream lookups, event creation and records, a stream switch, the one-launch kernel
through Triton's `JITFunction.run` and through the compiled kernel's launcher
(`batched.Launcher`), and a tiny kernel's round trip to completion.

Run (a machine with CUDA and Triton): python bench/bench_job_costs.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_transfer import _setup

from tiercache.transfer import batched


def per_call(fn: Callable[[], object], calls: int, runs: int) -> float:
    """Median over `runs` of the mean host time of `fn()`, microseconds."""
    fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_job_costs: CUDA is not available")
    dev = torch.device("cuda", torch.cuda.current_device())
    idx = dev.index
    _e, layout, tier, store_ids, _l, _s, _k = _setup(64, 16 * 1024, dev, 1, args.layers)
    layout.copy_mode = "direct"
    table = batched.ChunkTable(layout)
    pool = tier.pool
    s = torch.cuda.Stream(dev)
    done = torch.cuda.Event()
    done.record()
    torch.cuda.synchronize()
    costs: dict[str, float] = {}

    def jit() -> None:
        with torch.cuda.stream(s):
            batched.launch(
                table,
                [store_ids[0]],
                [0],
                pool.data_ptr(),
                layout.block_bytes,
                store=True,
                fast=False,
            )

    def fast() -> None:
        batched.launch(
            table, [store_ids[0]], [0], pool.data_ptr(), layout.block_bytes, store=True, stream=s
        )

    def round_trip() -> None:
        fast()
        ev = torch.cuda.Event()
        ev.record(s)
        ev.synchronize()

    def job_floor_3_events() -> None:  # a job's CUDA calls as the handler made them (3 events)
        compute = torch.cuda.current_stream(idx).record_event()
        s.wait_event(compute)
        start = torch.cuda.Event(enable_timing=True)
        start.record(s)
        fast()
        end = torch.cuda.Event(enable_timing=True)
        end.record(s)
        end.synchronize()
        start.elapsed_time(end)

    def job_floor_2_plain_events() -> None:  # caller's stream mark + one untimed end event
        compute = torch.cuda.Event()
        compute.record()
        s.wait_event(compute)
        fast()
        end = torch.cuda.Event()
        end.record(s)
        end.synchronize()

    def stream_ctx() -> None:
        with torch.cuda.stream(s):
            pass

    def timing_event() -> None:
        torch.cuda.Event(enable_timing=True).record(s)

    def plain_event() -> None:
        torch.cuda.Event().record(s)

    cases: dict[str, Callable[[], object]] = {
        "torch.cuda.current_stream(idx)": lambda: torch.cuda.current_stream(idx),
        "torch._C._cuda_getCurrentRawStream(idx)": lambda: torch._C._cuda_getCurrentRawStream(idx),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "current_stream(idx).record_event()": lambda: torch.cuda.current_stream(idx).record_event(),
        "Event(enable_timing=True).record(s)": timing_event,
        "Event().record(s)": plain_event,
        "s.wait_event(done)": lambda: s.wait_event(done),
        "done.query()": done.query,
        "with torch.cuda.stream(s): pass": stream_ctx,
        "pool.is_pinned()": pool.is_pinned,
        "layout.copy_mode_for(pool, 1)": lambda: layout.copy_mode_for(pool, 1),
        "layout.copy_mode_for(pool, 1, pool=True)": lambda: layout.copy_mode_for(
            pool, 1, pool=True
        ),
        "launch: JITFunction.run (in a stream context)": jit,
        "launch: compiled kernel's launcher": fast,
        "launch + event + synchronize (a job's GPU round trip)": round_trip,
        "job floor: 3 events (2 timed), wait, launch, sync, elapsed": job_floor_3_events,
        "job floor: 2 untimed events, wait, launch, sync": job_floor_2_plain_events,
    }
    print(
        f"# {torch.cuda.get_device_name(dev)}, {args.layers} layers, 16 KiB block, "
        f"median of {args.runs} runs of {args.calls} calls, host microseconds per call"
    )
    for name, fn in cases.items():
        costs[name] = per_call(fn, args.calls, args.runs)
        torch.cuda.synchronize()
        print(f"{costs[name]:8.2f} us  {name}", flush=True)
    # The two launch paths wrote the same bytes: the job's chunk of block store_ids[0].
    ref = pool[0].clone()
    pool[0].zero_()
    jit()
    torch.cuda.synchronize()
    assert torch.equal(pool[0], ref), "the compiled launcher and JITFunction.run differ"
    print("# the compiled launcher wrote what JITFunction.run writes")


if __name__ == "__main__":
    main()
