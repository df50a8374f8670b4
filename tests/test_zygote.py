"""tests/vllm/zygote.py, which the end-to-end tests fork their engine processes from: each child
must look like a fresh process of its own (exit code or signal, environment, working
directory, session, output files, atexit handlers), since the tests read it as a restart.
Here with a small script in place of tests/vllm/engine.py (no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path
from types import ModuleType

import pytest

ZYGOTE = Path(__file__).resolve().parent / "vllm" / "zygote.py"

SCRIPT = """
import atexit, importlib.util, json, os, sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("zygote_under_test", {zygote!r})
zygote = importlib.util.module_from_spec(spec)
spec.loader.exec_module(zygote)


def run(argv):
    out, how = Path(argv[0]), argv[1]
    atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))
    facts = {{"env": os.environ.get("ZYGOTE_TEST"), "cwd": os.getcwd(),
              "sid": os.getsid(0), "pid": os.getpid(), "json": "json" in sys.modules}}
    out.write_text(json.dumps(facts))
    print("out line")
    print("err line", file=sys.stderr)
    if how == "kill":
        sys.stdout.flush()
        os.kill(os.getpid(), 9)
    if how == "raise":
        raise RuntimeError("the child raised")
    return int(how)


if sys.argv[1:] == ["--zygote"]:
    zygote.serve(lambda args: run(args), ["json"])
"""


@pytest.fixture
def zygote(tmp_path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("zygote_under_test", ZYGOTE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_children_look_like_fresh_processes(
    zygote: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(zygote=str(ZYGOTE)))
    z = zygote.Zygote(script, sys.executable)
    try:
        results = {}
        for how in ("0", "3", "kill", "raise"):
            work = tmp_path / f"cwd-{how}"
            work.mkdir()
            monkeypatch.chdir(work)
            monkeypatch.setenv("ZYGOTE_TEST", f"env-{how}")
            out, logs = tmp_path / f"{how}.json", [tmp_path / f"{how}.{n}" for n in "oe"]
            child = z.start([str(out), how], *logs)
            results[how] = (child, child.wait(60), out, logs, work)
        for how, (child, code, out, (stdout, stderr), work) in results.items():
            want = {"0": 0, "3": 3, "kill": -signal.SIGKILL, "raise": 1}[how]
            assert code == want and child.poll() == want, (how, code)
            facts = json.loads(out.read_text())
            # The caller's environment and directory at start(), a session of its own, the
            # zygote's imports already there.
            assert facts["env"] == f"env-{how}" and facts["cwd"] == str(work), facts
            assert facts["sid"] == facts["pid"] == child.pid and facts["json"], facts
            assert "out line" in stdout.read_text() and "err line" in stderr.read_text()
            # An interpreter's exit: atexit handlers run, but not after SIGKILL.
            assert out.with_suffix(".atexit").exists() == (how != "kill"), how
            if how == "raise":
                assert "RuntimeError: the child raised" in stderr.read_text()
        assert len({r[0].pid for r in results.values()} | {os.getpid(), z.proc.pid}) == 6
    finally:
        z.close()
    assert z.proc.returncode == 0
