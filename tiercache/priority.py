"""Background threads (write-through copies, demotions between tiers) run at a lower CPU
priority than the engine's threads.

On a machine with few cores an engine's forward runs OpenMP threads on every core; a copy
thread that takes a core from one of them stalls the whole parallel region until the
scheduler gives the core back. Copies that nothing waits for (insurance against a crash,
demotions) therefore lower their own thread's priority: they still run at full speed on an
idle machine, and yield to the engine when it computes. Linux sets a nice value per thread
(`setpriority` on a thread id); raising one's own needs no privilege.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10  # added to the thread's nice value (capped at 19)


def lower_this_thread(increment: int = BACKGROUND_NICE) -> int | None:
    """Raise the calling thread's nice value by `increment`; its new value, or None where
    the platform cannot (the thread then runs at its old priority)."""
    if not hasattr(os, "setpriority"):
        return None
    tid = threading.get_native_id()
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        log.debug("could not lower the priority of thread %d: %s", tid, exc)
        return None
    return nice


def thread_nice(tid: int) -> int:
    """The nice value of thread `tid` of this process (Linux)."""
    return os.getpriority(os.PRIO_PROCESS, tid)
