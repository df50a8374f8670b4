"""Permission checks that run as root too (CI runs as root, where permission bits stop
nothing); no tests here.

- `as_unprivileged(check)`: run `check(dir)` on a fresh directory owned by the user that runs
  the check: this process's user when it is not root; as root, a forked child that first
  drops to `nobody` (uid and gid 65534, no supplementary groups). The child's failure is
  raised here with its traceback.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

NOBODY = 65534


def as_unprivileged(check: Callable[[Path], None]) -> None:
    # Not under pytest's tmp_path: as root it lies below a 0700 directory nobody cannot enter.
    base = Path(tempfile.mkdtemp(prefix="tiercache-unprivileged-"))
    try:
        if os.geteuid() != 0:
            check(base)
            return
        os.chown(base, NOBODY, NOBODY)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: nobody, then the check; never returns into pytest
            status = 1
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)  # last: after it, gid and groups could not change
                assert (os.geteuid(), os.getegid()) == (NOBODY, NOBODY)
                check(base)
                status = 0
            except BaseException:
                os.write(w, traceback.format_exc().encode())
            finally:
                os._exit(status)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            err = f.read().decode(errors="replace")
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        assert code == 0, f"the check, as uid {NOBODY}, exited {code}:\n{err}"
    finally:
        shutil.rmtree(base, ignore_errors=True)  # root removes what nobody's modes keep
