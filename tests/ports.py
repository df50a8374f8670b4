"""`free_port(also=0) -> int`: a TCP port for a test's server to bind, free on this host just
now and handed to no other caller of `free_port` while this process lives; with `also`, one
whose port + `also` is free and held too (a Redis cluster bus, the Prometheus ports of a
second rank).

Why not bind to port 0 and pass that on: such a port comes from the kernel's ephemeral range,
which the kernel also hands out for every outgoing connection and every later bind to port 0
(an engine's own ports, a Redis client's), so between the pick and the server's bind another
socket could take it ("Address already in use"; seen with two test processes at once, as CI
runs them). These ports lie below the ephemeral range, where the kernel never picks, and each
is held by a lock file (`flock`, released when the process exits) so that two test processes
(pytest-xdist workers, CI's two vLLM stages) never pick the same one.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile

_LOCKS = os.path.join(tempfile.gettempdir(), "tiercache-test-ports")
_held: list[int] = []  # the lock files' descriptors: held until the process exits


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range: 32768-60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))  # every interface: servers bind tcp://*:PORT
        except OSError:
            return False
    return True


def _hold(port: int) -> bool:
    """Take `port`'s lock file (False: another process, or this one, holds it)."""
    os.makedirs(_LOCKS, exist_ok=True)
    fd = os.open(os.path.join(_LOCKS, str(port)), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _held.append(fd)
    return True


def free_port(also: int = 0) -> int:
    low = 10000
    high = _ephemeral_low() - 1 - also  # port + also stays below the ephemeral range too
    if high < low:
        raise RuntimeError(f"no test port range below the ephemeral ports with also={also}")
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(low, high)
        wanted = [port, port + also] if also else [port]
        if all(_bindable(p) for p in wanted) and all(_hold(p) for p in wanted):
            return port
    raise RuntimeError(f"no free test port in {low}-{high + also} after 1000 tries")
