"""Engine processes forked from a zygote that has imported vLLM once, for the end-to-end tests.

Importing vLLM takes most of a tiny engine's start-up (several seconds of the ~10 s a fresh
interpreter needs for `engine.py` on two cores), and tests/vllm starts well over a hundred
engines. The zygote imports torch and vLLM once; each engine process is forked from it and is
still a fresh process: its own pid and session, the caller's environment and working directory,
nothing of tiercache imported and no engine built before it (the zygote only imports), and it
exits as an interpreter does (non-daemon threads joined, atexit handlers run). What vLLM spawns
itself (a multiprocess engine's core, TP workers) starts as before. Shared with the zygote:
Python's str-hash seed (set orders); `random` reseeds at fork, and vLLM draws its per-process
block-hash seed when an engine starts, in the child.

- `Zygote(script, preload)`: runs ``python SCRIPT --zygote``; `start(argv, stdout, stderr)`
  forks ``SCRIPT argv`` and returns a `Forked` (`pid`, `poll()`, `wait(timeout)`, as
  `subprocess.Popen` has them; the pid leads its own process group). The zygote reaps its
  children and writes each one's status to a file, so the caller sees the exit code (or the
  signal, negative) as it would of a child of its own.
- `serve(run, preload)`: the zygote's side (what ``SCRIPT --zygote`` calls): requests and
  answers are JSON lines on its stdin and stdout (nothing is unpickled).

`engine.fork_from_zygote()` turns it on (tests/vllm/conftest.py does, unless
``TIERCACHE_TEST_ZYGOTE=0``: every engine then starts in a new interpreter, as the benchmarks'
engines always do).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Forked", "Zygote", "serve"]


def serve(run: Callable[[list[str]], int], preload: Sequence[str]) -> None:
    """The zygote: import `preload`, then fork one child per request line and answer with its
    pid. A child runs ``run(argv)`` and exits with its result as an interpreter would (the
    SystemExit leaves this function); the zygote reaps it and writes its status file."""
    before = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    # What the imports set in the environment, a fresh interpreter would have set too.
    imported = {k: v for k, v in os.environ.items() if before.get(k) != v}
    status_of: dict[int, str] = {}  # child pid -> its status file
    ended: dict[int, int] = {}  # reaped before its pid was recorded

    def write_status(path: str, code: int) -> None:
        Path(path + ".tmp").write_text(str(code))
        os.replace(path + ".tmp", path)

    def reap(signum: int, frame: Any) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            if pid in status_of:
                write_status(status_of.pop(pid), code)
            else:
                ended[pid] = code

    signal.signal(signal.SIGCHLD, reap)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_child(req, imported)
            raise SystemExit(run(req["argv"]))  # leaves the loop: the interpreter's own exit
        status_of[pid] = req["status"]
        if pid in ended:
            write_status(status_of.pop(pid), ended.pop(pid))
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


def _become_child(req: dict[str, Any], imported: dict[str, str]) -> None:
    """In a freshly forked child: its own session, default signal handling, the request's
    environment, working directory and output files."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update({**req["env"], **imported})
    os.chdir(req["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [req["script"], *req["argv"]]


class Forked:
    """A process forked by the zygote, seen as `subprocess.Popen` shows a child."""

    def __init__(self, pid: int, status: Path, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._status = status
        self._zygote = zygote

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), or None while it runs."""
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        if self.returncode is None and self._zygote.proc.poll() is not None:
            raise RuntimeError(f"the engine zygote died; its child {self.pid} is unaccounted for")
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait until it ended (subprocess.TimeoutExpired after `timeout` seconds)."""
        end = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        return code


class Zygote:
    """The caller's handle on a zygote process (``python SCRIPT --zygote``)."""

    def __init__(self, script: str | Path, python: str = sys.executable) -> None:
        self.script = str(script)
        self._dir = tempfile.TemporaryDirectory(prefix="tiercache-zygote-")
        self._log = Path(self._dir.name, "zygote.log")
        with self._log.open("w") as log:
            self.proc = subprocess.Popen(
                [python, self.script, "--zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
            )
        self._lock = threading.Lock()
        self._count = 0
        atexit.register(self.close)

    def start(self, argv: Sequence[str], stdout: Path, stderr: Path) -> Forked:
        """Fork ``SCRIPT argv`` with this process's environment and working directory."""
        with self._lock:
            self._count += 1
            status = Path(self._dir.name, f"{self._count}.status")
            req = {
                "script": self.script,
                "argv": list(argv),
                "env": dict(os.environ),
                "cwd": os.getcwd(),
                "stdout": str(stdout),
                "stderr": str(stderr),
                "status": str(status),
            }
            assert self.proc.stdin is not None and self.proc.stdout is not None
            try:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                raise self._died() from None
            line = self.proc.stdout.readline()
        if not line:
            raise self._died()
        return Forked(int(json.loads(line)["pid"]), status, self)

    def _died(self) -> RuntimeError:
        return RuntimeError(f"the engine zygote died:\n{self._log.read_text()[-4000:]}")

    def close(self) -> None:
        """End the zygote (its children, in sessions of their own, run on)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()
