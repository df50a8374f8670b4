"""The servers `bench/bench_serve.py` drives: `vllm serve` per configuration (`Server`, with
vLLM's `kv_transfer_config` from `kv_config`), and the stores some configurations need beside
it: a redis-server (`redis_server`) and LMCache's multiprocess server (`lmcache_server`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

# The server's logging: vLLM's INFO lines, and the connector's one DEBUG line per admission
# (`tiercache.connectors.vllm_kv.admissions`): request id, tokens from the engine's cache and
# from tiercache.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s"}},
    "handlers": {
        "out": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {
        "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
        "tiercache.connectors.vllm_kv.admissions": {
            "handlers": ["out"],
            "level": "DEBUG",
            "propagate": False,
        },
    },
}
METRICS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:num_preemptions_total",  # a preempted request computes its blocks again
    "vllm:iteration_tokens_total_sum",  # tokens the engine computed (each step's)
    "vllm:iteration_tokens_total_count",  # steps
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_config(
    name: str, work: Path, args: argparse.Namespace, redis_url: str, lmcache_port: int = 0
) -> dict | None:
    """vLLM's `kv_transfer_config` for configuration `name` (None: no connector)."""
    if name in ("prefix", "allcache"):  # no connector (allcache: a larger engine cache)
        return None
    if name == "lmcache":
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": lmcache_port,
            },
        }
    lower = {
        "cpu": [],
        "nvme": [{"kind": "nvme", "path": str(work / "nvme"), "capacity": args.disk_capacity}],
        "lmdb": [{"kind": "lmdb", "path": str(work / "lmdb"), "capacity": args.disk_capacity}],
        "redis": [{"kind": "redis", "url": redis_url, "capacity": args.disk_capacity}],
    }[name]
    cpu = args.cpu_capacity if name == "cpu" else args.small_cpu
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "config": {"tiers": [{"kind": "cpu", "capacity": cpu}, *lower]},
            "memory_loads": args.memory_loads,
        },
    }


class Server:
    """`vllm serve` (the API server module, multiprocess) in a process group of its own;
    a context manager that kills the whole group on exit."""

    def __init__(self, model: Path, log: Path, kv: dict | None, args: argparse.Namespace):
        self.port = free_port()
        self.model = str(model)
        self.name = log.stem.removeprefix("server-")
        cmd = [
            *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model),
            *("--host", "127.0.0.1", "--port", str(self.port), "--block-size", str(args.block)),
            *("--max-model-len", str(args.max_model_len), "--dtype", "float32"),
            *("--num-gpu-blocks-override", str(args.engine_blocks)),
            *("--max-num-seqs", str(max(args.concurrency)), "--seed", "0"),
            *("--enable-prefix-caching", "--enable-prompt-tokens-details"),
        ]
        if args.enforce_eager:
            cmd.append("--enforce-eager")
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        self.cmd, self.log = cmd, log
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space_gib)}
        logging_config = log.with_name(log.stem + "-logging.json")
        logging_config.write_text(json.dumps(LOGGING))
        self.env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_config)
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # vLLM-cpu reserves one more core when any kv_transfer_config is set (for NIXL's
        # transfers): on a 2-core host a server with a connector then runs its forward on 2
        # OpenMP threads and one without on 1, a ~1.9x difference that is not the connector's
        # (measured with no reuse at all). Every configuration gets the reservation vLLM makes
        # without a connector (one core per local worker, TP=1 here), unless the user set one.
        self.env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
            )  # fmt: skip
        t0 = time.monotonic()
        while time.monotonic() - t0 < 600:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
                return self
            time.sleep(0.5)
        raise RuntimeError("server did not start in 600 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core and worker too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)

    def counters(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        out = {}
        for name in METRICS:
            values = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
            out[name.removeprefix("vllm:").removesuffix("_total")] = sum(map(float, values))
        return out


@contextlib.contextmanager
def lmcache_server(log: Path, args: argparse.Namespace) -> Any:
    """LMCache's multiprocess server (what `LMCacheMPConnector` talks to), in a process group
    of its own; yields its port."""
    from tiercache.config import parse_size

    port = free_port()
    l1_gb = parse_size(args.cpu_capacity, "--cpu-capacity") / 2**30
    cmd = [
        *(sys.executable, "-m", "lmcache.v1.multiprocess.http_server", "--host", "127.0.0.1"),
        *("--port", str(port), "--http-host", "127.0.0.1", "--http-port", str(free_port())),
        *("--chunk-size", "256", "--l1-size-gb", f"{l1_gb:g}", "--eviction-policy", "LRU"),
        *("--supported-transfer-mode", "auto", "--disable-observability"),
    ]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the LMCache server exited: {log.read_text()[-3000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the LMCache server did not listen in 300 s")
            time.sleep(0.5)
        yield port
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)


@contextlib.contextmanager
def redis_server(work: Path) -> Any:
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(work)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(0.5)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()
