"""Fixtures for the end-to-end tests on a real vLLM CPU engine.

- `tiny_llama` (session): a directory with a random-weight Llama (see `engine.py`).
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
REDIS_SERVER = shutil.which("redis-server")


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
    """The `tests/vllm/engine.py` module."""
    return _load("engine")


@pytest.fixture(scope="session")
def server() -> ModuleType:
    """The `tests/vllm/server.py` module."""
    return _load("server")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, engine: ModuleType) -> Path:
    """A random-weight Llama model directory for vLLM (config.json + model.safetensors)."""
    return engine.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


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
