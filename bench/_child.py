"""`child_json`: run a bench's child process and return the JSON object on its last stdout
line. A child that fails raises with the end of its stderr, so the real error (for example
"no room for the LMDB map" on a full disk) shows instead of a bare `CalledProcessError`."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any


def child_json(
    cmd: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    what: str = "child",
) -> Any:
    """Run `cmd`; the JSON value of its last stdout line. RuntimeError naming `what`, the exit
    status and the last 4,000 characters of stderr if it fails or prints no JSON."""
    out = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (exit status {out.returncode}):\n{out.stderr[-4000:]}")
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise RuntimeError(
            f"{what} printed no JSON on its last line ({exc}): {lines[-1][:200]!r}\n"
            f"{out.stderr[-4000:]}"
        ) from None
