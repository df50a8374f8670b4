"""Shared machinery of the reliability campaigns (`tests/test_campaign_*.py`); no tests here.

- `scale(name, default)`: an iteration count, overridable by the env var `TIERCACHE_<NAME>`.
- `report(campaign, **figures)`: prints one `CAMPAIGN {json}` line and appends it to the file
  named by `TIERCACHE_CAMPAIGN_REPORT` (how the long runs' figures reach the README's
  Guarantees section).
- `key(i)`, `payload(i, bb)`, `blocks(ids, bb)`: deterministic block contents, so any block a
  store serves can be checked byte for byte against what was written for its key;
  `gets(cache, ids)` / `served(cache, ids)`: the ids (counts) read exact, missed and wrong
  through a TierCache; `lmdb_entries(store)`: each block's header and payload bytes.
- `run_child(fn, *args)`: run `fn` in a fresh process forked from a zygote process that has
  torch and the tiers imported (a new interpreter costs ~1.4 s here, a fork a few ms), and
  return its result. Requests and results are JSON (nothing is unpickled). A child that dies
  (signal, os._exit) comes back as `ChildDied`, never as a hang.
- `start_child(fn, *args)`: the same, unwaited (the crash campaign SIGKILLs it).
- `open_tier(kind, path, bb, cap, **opts)`, `read_all(tier)`: the persistent tiers as the
  campaigns open them, and a verified read of everything a tier recovered.
- `cli_verify(path)`: `tiercache verify PATH --json` when that command exists, else None.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def repo_env() -> dict[str, str]:
    """This environment for a child interpreter that imports tiercache from this checkout: the
    repository ahead of the PYTHONPATH it has (which may hold the dependencies)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


_PRELOAD = ["torch", "numpy", "lmdb", "tiercache.tiers.nvme", "tiercache.tiers.lmdb"]


def scale(name: str, default: int) -> int:
    """`default`, or the int in env var `TIERCACHE_<NAME>` (e.g. TIERCACHE_CRASH_ITERS=500)."""
    raw = os.environ.get(f"TIERCACHE_{name.upper()}")
    if raw is None:
        return default
    value = int(raw)
    if value < 1:
        raise ValueError(f"TIERCACHE_{name.upper()}: expected an int >= 1, got {raw!r}")
    return value


def report(campaign: str, **figures: Any) -> dict[str, Any]:
    """Print the campaign's figures (pytest -s shows them) and append them to the report file."""
    line = {"campaign": campaign, **figures}
    text = json.dumps(line, sort_keys=True)
    print(f"CAMPAIGN {text}")
    dest = os.environ.get("TIERCACHE_CAMPAIGN_REPORT")
    if dest:
        with open(dest, "a", encoding="utf-8") as f:
            f.write(text + "\n")
    return line


# -- block contents --------------------------------------------------------------------------
def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def key_id(k: bytes) -> int:
    return int.from_bytes(k, "big")


def payload(i: int, bb: int) -> np.ndarray:
    """The bytes written for key id `i`: random for odd ids; bf16-like (a narrow high byte,
    so zstd pays and the compressed path runs) for even ids."""
    a = np.random.default_rng(i).integers(0, 256, bb, dtype=np.uint8)
    if i % 2 == 0:
        a[1::2] &= 0x07
    return a


def blocks(ids: Iterable[int], bb: int) -> torch.Tensor:
    rows = [payload(i, bb) for i in ids]
    if not rows:
        return torch.empty((0, bb), dtype=torch.uint8)
    return torch.from_numpy(np.stack(rows))


def gets(cache: Any, ids: Iterable[int]) -> tuple[list[int], list[int], list[int]]:
    """Get each of `ids` alone through a TierCache: (ids read exact, missed, served wrong)."""
    hit: list[int] = []
    miss: list[int] = []
    wrong: list[int] = []
    for i in ids:
        got = cache.get([key(i)])
        if len(got) == 0:
            miss.append(i)
        elif np.array_equal(got[0].numpy(), payload(i, cache.block_bytes)):
            hit.append(i)
        else:
            wrong.append(i)
    return hit, miss, wrong


def served(cache: Any, ids: Iterable[int]) -> tuple[int, int, int]:
    """(exact, missed, wrong) over single-block gets of `ids` through a TierCache."""
    hit, miss, wrong = gets(cache, ids)
    return len(hit), len(miss), len(wrong)


def load_on_this_thread(
    cache: Any, src: int, slots: Any, keys: tuple[bytes, ...], dst_slots: tuple[int, ...]
) -> Any:
    """Load `keys` (a `prepare_load` of `cache`'s manager: tier `src`, `slots`) into rows
    `dst_slots` of its first tier through the transfer engine's `DiskHandler`, on this thread
    as a lane would, then complete the manager's load; the job's `TransferResult`."""
    from tiercache.transfer import TierLoadStoreSpec
    from tiercache.transfer.disk_handler import DiskHandler
    from tiercache.transfer.job import Job

    tiers = cache.tiers
    handler = DiskHandler(tiers, threads=1)
    try:
        job = Job(
            1,
            TierLoadStoreSpec(src, tiers[src].medium, slots, keys),
            TierLoadStoreSpec(0, tiers[0].medium, dst_slots, keys),
        )
        handler.check(job)
        handler.run(job, handler.lane_of(job))
    finally:
        handler.close()
        with cache.lock:
            cache.manager.complete_load(keys)
    return job.result()


def lmdb_entries(store: str | Path) -> dict[int, tuple[bytes, bytes]]:
    """Block id -> (its "heads" value, its stored payload) in an LMDB store, read without
    a lock (the campaigns then locate these bytes in data.mdb)."""
    import lmdb

    from tiercache.tiers.lmdb import layout as lmdb_tier

    env = lmdb.open(str(store), readonly=True, lock=False, max_dbs=4, subdir=True)
    try:
        heads = env.open_db(lmdb_tier.HEADS_DB, create=False)
        blocks_db = env.open_db(lmdb_tier.BLOCKS_DB, create=False)
        with env.begin() as txn:
            return {
                key_id(bytes(k[-16:])): (bytes(h), bytes(txn.get(k, db=blocks_db)))
                for k, h in txn.cursor(db=heads)
            }
    finally:
        env.close()


# -- tiers -----------------------------------------------------------------------------------
def open_tier(kind: str, path: str | Path, bb: int, cap: int, **opts: Any) -> Any:
    """An NVMe or LMDB tier over `path` with namespace "campaign" unless given."""
    ns = opts.pop("namespace", "campaign")
    if kind == "nvme":
        from tiercache.tiers.nvme import NVMeTier

        return NVMeTier(path=str(path), block_bytes=bb, capacity_blocks=cap, namespace=ns, **opts)
    from tiercache.tiers.lmdb import LMDBTier

    return LMDBTier(path=str(path), block_bytes=bb, capacity_blocks=cap, namespace=ns, **opts)


def read_all(tier: Any) -> dict[str, list[int]]:
    """Read every block the tier recovered; key ids that read back exact ("good"), that the
    tier reported failed ("failed"), and that it served with other bytes ("wrong")."""
    rec = tier.recover()
    good: list[int] = []
    failed: list[int] = []
    wrong: list[int] = []
    step = 16
    for a in range(0, len(rec), step):
        part = rec[a : a + step]
        out = torch.empty((len(part), tier.block_bytes), dtype=torch.uint8)
        bad = set(tier.read([s for _, s in part], out, [k for k, _ in part]))
        for j, (k, _) in enumerate(part):
            i = key_id(k)
            if j in bad:
                failed.append(i)
            elif np.array_equal(out[j].numpy(), payload(i, tier.block_bytes)):
                good.append(i)
            else:
                wrong.append(i)
    return {"good": good, "failed": failed, "wrong": wrong}


# -- child processes ------------------------------------------------------------------------
class ChildDied(RuntimeError):
    """A campaign child ended without a result (killed by a signal, or exited)."""


class ChildFailed(AssertionError):
    """A campaign child raised; carries its traceback."""


def _zygote_main() -> None:
    """The zygote: imports torch and the tiers once, then forks one child per request line
    (JSON: fn "module:function", args, out path) and answers with the child's pid. Children
    write their JSON result to `out` (tmp + rename). SIGCHLD is ignored, so children are
    reaped by the kernel and a dead child's pid simply disappears."""
    import signal

    for name in [*_PRELOAD, "tests.campaign_children"]:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 0
            try:
                mod, _, fn = req["fn"].partition(":")
                value = {"ok": getattr(importlib.import_module(mod), fn)(*req["args"])}
            except BaseException as exc:
                value = {"raised": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
                code = 1
            tmp = req["out"] + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(value, f)
            os.replace(tmp, req["out"])
            os._exit(code)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()


class _Zygote:
    """The parent's handle on the zygote process (started on first use, one per session)."""

    def __init__(self) -> None:
        code = f"import sys; sys.path.insert(0, {str(REPO)!r}); " + (
            "from tests.campaign_support import _zygote_main; _zygote_main()"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lock = threading.Lock()
        self.results = Path(tempfile.mkdtemp(prefix="tiercache-campaign-"))
        atexit.register(shutil.rmtree, self.results, True)
        self.count = 0

    def fork(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[int, Path]:
        with self.lock:
            self.count += 1
            out = self.results / f"{self.count}.json"
            req = {"fn": f"{fn.__module__}:{fn.__name__}", "args": list(args), "out": str(out)}
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the campaign zygote process died")
        return int(line), out


_zygote: _Zygote | None = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Child:
    """A campaign child forked from the zygote; `result()` waits for its return value."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        global _zygote
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = _Zygote()
        self.pid, self._out = _zygote.fork(fn, args)

    def is_alive(self) -> bool:
        return not self._out.exists() and _alive(self.pid)

    def kill(self) -> None:
        """SIGKILL, then wait until the kernel has reaped it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _alive(self.pid):
            if time.monotonic() > deadline:
                raise AssertionError(f"campaign child {self.pid} survived SIGKILL")
            time.sleep(0.0005)

    def result(self, timeout: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout
        while not self._out.exists():
            if not _alive(self.pid):
                if self._out.exists():
                    break
                raise ChildDied(f"campaign child {self.pid} ended without a result")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"campaign child {self.pid} hung for {timeout} s; killed")
            time.sleep(0.0005)
        value = json.loads(self._out.read_text(encoding="utf-8"))
        self._out.unlink()
        if "raised" in value:
            raise ChildFailed(value["raised"])
        return value["ok"]


def start_child(fn: Callable[..., Any], *args: Any) -> Child:
    """Fork `fn(*args)` (a module-level function; JSON-able args and result) from the zygote."""
    return Child(fn, args)


def run_child(fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> Any:
    """`fn(*args)` in a fresh forked process; its result, ChildFailed or ChildDied."""
    return Child(fn, args).result(timeout)


# -- the CLI's verify, once it exists ---------------------------------------------------------
def cli_verify(path: str | Path) -> dict[str, Any] | None:
    """Run `tiercache verify PATH --json`; its JSON, or None when the command does not exist."""
    if importlib.util.find_spec("tiercache.cli.verify") is None:
        return None
    proc = subprocess.run(
        [sys.executable, "-m", "tiercache", "verify", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(
            f"tiercache verify {path} gave no JSON (exit {proc.returncode}): {proc.stderr}"
        ) from None
    return {"returncode": proc.returncode, "report": out}
