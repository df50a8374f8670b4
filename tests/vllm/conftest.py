"""Fixtures for the end-to-end tests on a real vLLM CPU engine.

- `tiny_llama` (session): a directory with a random-weight Llama (see `engine.py`).
- `llama_prompts`, `llama_outputs` (session): a prompt set (8 x 200 tokens, 64 shared) and
  its greedy outputs without a connector, one engine run for every module that uses them.
- `engine` (session): the `engine.py` module: `run_in_subprocess(spec)`, `make_prompts`,
  `write_tiny_llama`, `run_spec`.
- `redis_url` (session): a real redis-server on a free loopback port (a skip where none is
  installed, a failure when the environment variable CI is set).
- `server` (session): the `server.py` module: `Server` (vLLM's OpenAI-compatible server in
  its own process group), `free_port`, `get`.

Engines run in fresh subprocesses (`engine.run_in_subprocess`): every run starts clean, like a
server restart, and the test process never holds an engine's memory. Test modules skip
themselves with ``pytest.importorskip("vllm")`` when vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

_HERE = Path(__file__).resolve().parent
# torch's inductor compiles a few of vLLM's functions (with TP > 1, the masked vocabulary
# lookup of the embedding) and first checks each vector ISA by loading a test library in a
# child process, given 60 s. On a loaded 2-core host that probe can time out ("VecISA dlopen
# probe ... hung after 60s"): the process then takes a narrower ISA than the others, and a
# kernel it loads from the inductor cache they filled computes garbage (reproduced alone:
# masked token ids of 1.4e14; in a TP=2 engine the worker dies on "index out of range in
# self" in its first step, likely also the first-step RPC timeout CI once saw on vLLM 0.33).
# With this set, every process takes the ISA its CPU flags name, without the probe.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
REDIS_SERVER = shutil.which("redis-server")


# What CI runs on vLLM 0.33 besides 0.32 (`-m every_vllm`; .ci/run). vLLM 0.33 changed
# interfaces the adapters use (../shared/vllm-interfaces.md): OffloadingManager (`lock`,
# `config_info`, `on_reset_flushed`, `OffloadingEvent.metadata_only`),
# `OffloadingWorker.submit_load(expedited)`, the offloading group configs (sliding windows:
# the OffloadingConnector now stores and loads only the window), KVConnectorBase_V1's optional
# sleep-mode methods, and `BlockStored.lookahead_token_ids`. Every test that goes through the
# connector's interface (the KV connector's or the offloading spec's, in an engine or by
# their halves) runs on 0.33 too: what vLLM calls, in which order and with what, is the
# installed vLLM's, whatever tiercache behaviour the test is about (issue 47). Left to 0.32:
# settings refused at start-up, the OpenAI server's tests except the router's (the server
# runs on the overlay, but CI's time does not allow them all twice), the AMX host check, and
# the tests below that only add a scenario of tiercache's own on the same calls.
# Module -> test-name prefixes (None: every test of the module).
EVERY_VLLM: dict[str, tuple[str, ...] | None] = {
    # the connector against vLLM's base class (0.33's sleep-mode methods), worker metadata,
    # TP index and handshakes: no engine, seconds.
    "test_kv_connector_parts.py": None,
    # the spec, manager and worker on vLLM's own offloading classes (every 0.33 change to
    # the offloading API), and engines: hits, restart, corruption, expedited loads, keys.
    "test_offloading_spec.py": None,
    # replays vLLM's OffloadingConnector scheduler calls into vLLM's own manager: the calls
    # must be the installed vLLM's.
    "test_bench_agreement.py": None,
    # the EC connector inside vLLM's own scheduler/model-runner classes: no engine.
    "test_ec_connector.py": None,
    # cost-aware loading through the connector's halves and vLLM's metadata hooks
    # (bind_connector_metadata, worker metadata): no engine, seconds.
    "test_cost_loading.py": ("test_a_slow_tier", "test_worker_samples"),
    # the OffloadingConnector's store jobs given up at a deadline, then a prefix-cache reset
    # while they hang (0.33 changed how it waits for stores in flight: on_reset_flushed).
    # Not [cpu+nvme]: there vLLM's jobs end at once and only tiercache's write-through hangs.
    "test_hung_store.py": tuple(
        f"test_a_hung_store_gives_vllm_its_blocks_back_through_the_offloading_spec[{t}]"
        for t in ("nvme", "cpu+nvme-write-back")
    ),
    # the OffloadingConnector with sliding-window groups (0.33 stores only the window).
    "test_hybrid.py": ("test_offloading_spec_keeps_the_groups",),
    # TierCacheConnector end to end: cold then served after a prefix-cache reset, with its
    # KV events (0.33's BlockStored); restarts on persistent tiers, in process and
    # multiprocess (the scheduler's hits from the worker's handshake), and the override
    # that changes KV. Not test_c_ (corrupted store): the load-error path
    # (get_block_ids_with_load_errors, the failure policy) is the one test_b_'s multiprocess
    # engine and test_direct_loads reach.
    "test_kv_connector.py": ("test_a_", "test_b_"),
    # head shards (issue 32): KV stored under one TP size and loaded under another, in
    # process and multiprocess, TP=1 and TP=2 engines live on one store, fresh engines on a
    # persistent store. Not the "rank" and refused-setting tests: settings, 0.32 covers them.
    "test_tp_layout.py": ("test_tp1_", "test_tp2_"),
    # fleets: engines sharing one store live (LMDB, Redis with producer/consumer roles;
    # the scheduler probing the shared tier), replicas of one config, two engines over Redis.
    "test_fleet_multiprocess.py": None,
    "test_redis_shared.py": None,
    # a hung Redis under a multiprocess engine: the scheduler's probe and the worker's
    # load deadlines, then hits again.
    "test_hung_redis.py": None,
    # chains longer than the first tier (write-around), restarts in and across modes, and
    # write-through surviving a SIGKILL.
    "test_long_chains.py": None,
    # a block evicted by another process: the KV connector's and the offloading spec's
    # worker paths, and two engines on one store.
    "test_evicted_elsewhere.py": None,
    # a block moving into a hung tier, served by the KV connector's and the offloading
    # spec's lookups and loads.
    "test_moving_reads.py": None,
    # the in-process connector's asynchronous loads straight from a persistent tier under
    # "recompute" (issue 35): the scheduler and worker halves on vLLM's Request, no engine.
    "test_direct_loads.py": None,
    # the test router (tests/kv_router.py) decoding the installed vLLM's own
    # ZmqEventPublisher (0.33's BlockStored adds lookahead_token_ids) and hashing with its
    # block hasher, then against one `vllm serve`'s own events.
    "test_kv_router.py": None,
    # the connector's events as routers read them (vLLM's BlockStored fields per version):
    # two `vllm serve` engines on one store (LMDB, Redis) and the test router.
    "test_router_events.py": None,
    # the scheduler's event translation and shared-store credit on vLLM's own event classes;
    # not the sweep's cost among a million blocks (tiercache's own maps, seconds to fill).
    "test_kv_events.py": None,
    "test_kv_events_shared.py": (
        *("test_an_", "test_evictions_", "test_another_", "test_catalog_", "test_redis_"),
        *("test_a_block_", "test_the_", "test_descriptions_"),
    ),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "every_vllm: run on every supported vLLM, not only on 0.32 (conftest.EVERY_VLLM)",
    )


# The longest modules (several engine starts each, minutes on a 2-core host), longest
# first. CI runs each vLLM stage with `-n 2 --dist loadfile` (.ci/run), a module whole on one
# worker, in collection order: a long module collected last would run alone at the end.
SLOW_FIRST = (
    "test_tp_layout.py",
    "test_hybrid.py",
    "test_fleet_multiprocess.py",
    "test_offloading_spec.py",
    "test_long_chains.py",
    "test_server.py",
)


def _start_rank(item: pytest.Item) -> int:
    path = Path(str(item.fspath))
    if path.parent == _HERE and path.name in SLOW_FIRST:
        return SLOW_FIRST.index(path.name)
    return len(SLOW_FIRST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_start_rank)  # stable: the order within a module, and of the rest, stays
    for item in items:
        path = Path(str(item.fspath))
        if path.parent != _HERE or path.name not in EVERY_VLLM:
            continue
        prefixes = EVERY_VLLM[path.name]
        if prefixes is None or item.name.startswith(prefixes):
            item.add_marker(pytest.mark.every_vllm)


def _load(stem: str) -> ModuleType:
    # Loaded by path: pytest runs with --import-mode=importlib, so tests/vllm is not on
    # sys.path, and engine.py must also run as a plain script in the subprocesses.
    name = f"tiercache_tests_vllm_{stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def engine() -> ModuleType:
    """The `tests/vllm/engine.py` module; its engines fork from a zygote that has vLLM
    imported (`zygote.py`), unless ``TIERCACHE_TEST_ZYGOTE=0``."""
    module = _load("engine")
    module.fork_from_zygote(os.environ.get("TIERCACHE_TEST_ZYGOTE", "1") != "0")
    return module


@pytest.fixture(scope="session")
def kv_connector_module() -> ModuleType:
    """`tests/vllm/test_kv_connector.py` (its store-corrupting helper, `corrupt_records`)."""
    return _load("test_kv_connector")


@pytest.fixture(scope="session")
def server() -> ModuleType:
    """The `tests/vllm/server.py` module."""
    return _load("server")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, engine: ModuleType) -> Path:
    """A random-weight Llama model directory for vLLM (config.json + model.safetensors)."""
    return engine.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# The prompt set several modules send (test_kv_connector, test_redis_shared), and its outputs
# from an engine without a connector, computed once per session.
N_PROMPTS = 8
PROMPT_LEN = 200  # 6 full blocks of 32; the 7th holds the last prompt token
SHARED_PREFIX = 64  # two blocks common to all prompts


@pytest.fixture(scope="session")
def llama_prompts(engine: ModuleType) -> list[list[int]]:
    """8 prompts of 200 tokens whose first 64 are common to all."""
    prompts: list[list[int]] = engine.make_prompts(
        N_PROMPTS, PROMPT_LEN, seed=7, shared_prefix=SHARED_PREFIX
    )
    return prompts


@pytest.fixture(scope="session")
def llama_outputs(
    engine: ModuleType, tiny_llama: Path, llama_prompts: list[list[int]]
) -> list[list[int]]:
    """`llama_prompts`' greedy outputs (16 tokens) from an engine without a connector."""
    spec = {"model": str(tiny_llama), "batches": [{"prompts": llama_prompts, "max_tokens": 16}]}
    outputs: list[list[int]] = engine.run_in_subprocess(spec)["batches"][0]["outputs"]
    # The model is a useful oracle only if different prompts give different tokens.
    assert len({tuple(o) for o in outputs}) == N_PROMPTS
    return outputs


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port (skips where it is not installed, except
    under CI: there a missing redis-server fails the tests that need it, never skips them)."""
    if REDIS_SERVER is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set and redis-server is not installed: .ci/run installs it")
        pytest.skip("redis-server is not installed (CI installs Debian's redis-server package)")
    d = tmp_path_factory.mktemp("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert REDIS_SERVER is not None
    proc = subprocess.Popen(
        [
            *(REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d)),
            *("--save", "", "--appendonly", "no", "--daemonize", "no"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()
