"""A hung Redis under a serving engine (issue 16): every request still completes, with the
outputs of an engine without tiercache, and hits come back once Redis does.

Engine A stores two prompt sets into a cpu + Redis store and exits. Engine B (vLLM's default
multiprocess mode) opens the store, so its index holds A's blocks, all of them only in
Redis. The test then SIGSTOPs the redis-server: B's hits on the first set cannot be had
(the scheduler's probe, which confirms what the index says a shared tier holds, times out
on its own thread; a load already promised would miss its `[deadlines] load_timeout`), vLLM
recomputes those blocks, and the batch ends within a bound far below "forever". After
SIGCONT and the back-off, the second set hits Redis again.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm")

BLOCK = 32


def _redis_pid(url: str) -> int:
    """The pid of the server at `url`, from the server itself."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def _counter(result: dict[str, Any], name: str) -> int:
    return sum(int(s["counters"].get(name, 0)) for s in result["stores"].values())


def test_a_hung_redis_never_hangs_the_engine(
    engine: ModuleType, tiny_llama: Path, redis_url: str, tmp_path: Path
) -> None:
    first = engine.make_prompts(4, 260, seed=31)
    second = engine.make_prompts(4, 260, seed=32)
    warm = engine.make_prompts(1, 40, seed=33)
    tiers = [
        {"kind": "cpu", "blocks": 4},
        {
            "kind": "redis",
            "url": redis_url,
            "blocks": 256,
            "prefix": f"hung-{tmp_path.name}:",
            "timeout": 1.0,
            "backoff_max": 1.0,
        },
    ]
    kv = engine.tiercache_kv(
        {
            "namespace": "hung-e2e",
            "tiers": tiers,
            "deadlines": {"load_timeout": 0.5, "backoff": 1.0, "backoff_max": 2.0},
        }
    )
    # A, and at the same time an engine without tiercache (the outputs to match).
    base, _ = engine.run_together(
        [
            {
                "model": str(tiny_llama),
                "batches": [
                    {"prompts": first, "max_tokens": 8},
                    {"prompts": second, "max_tokens": 8},
                ],
            },
            {
                "model": str(tiny_llama),
                "multiprocessing": True,
                "kv_transfer_config": kv,
                "batches": [{"prompts": first + second, "max_tokens": 8}],
            },
        ]
    )
    want1, want2 = (b["outputs"] for b in base["batches"])
    ready, stopped, one_done, resumed = (tmp_path / n for n in ("r", "s", "1", "c"))
    b = engine.start_in_subprocess(
        {
            "model": str(tiny_llama),
            "multiprocessing": True,
            "kv_transfer_config": kv,
            "batches": [
                {"prompts": warm, "max_tokens": 2, "touch": str(ready)},
                {
                    "prompts": first,
                    "max_tokens": 8,
                    "wait_for": str(stopped),
                    "touch": str(one_done),
                },
                # Once Redis is back and every back-off in B ended (the Redis tier's and
                # probe's retry, the circuit breaker's, the scheduler's view of it).
                {
                    "prompts": second,
                    "max_tokens": 8,
                    "wait_for": str(resumed),
                    "wait_serving": True,
                },
            ],
        }
    )
    pid = _redis_pid(redis_url)
    paused = False
    try:
        b.wait_for(ready, 300)
        # B's index holds A's blocks, only in Redis. Now Redis hangs.
        os.kill(pid, signal.SIGSTOP)
        paused = True
        stopped.touch()
        # "Never stuck": the batch ends while Redis is still hung. The bound is generous (a
        # hung engine would wait for ever); the deadline is 0.5 s, the socket timeout 1 s.
        b.wait_for(one_done, 120)
        os.kill(pid, signal.SIGCONT)
        paused = False
        resumed.touch()
        result = b.result(300)
    finally:
        if paused:
            os.kill(pid, signal.SIGCONT)
        b.kill()
    _, hung, after = result["batches"]
    print("waited for the back-offs:", after["waited_s"], "s; started with", after["suspended_s"])
    assert hung["outputs"] == want1  # recomputed, identical
    # Nothing came from the hung Redis: the scheduler's probe (it confirms what the index
    # says a shared tier holds) timed out, or a load missed its deadline; either way vLLM
    # recomputed, and nothing waited for Redis.
    assert sum(hung["num_cached_tokens"]) == 0
    assert _counter(result, "loaded_blocks") * BLOCK <= sum(after["num_cached_tokens"])
    assert after["outputs"] == want2
    # Redis serves again, every loadable token of the second set: A closed (so Redis holds
    # all it stored) and B's index still lists those blocks in Redis.
    assert after["num_cached_tokens"] == [(len(p) - 1) // BLOCK * BLOCK for p in second]
