"""`free_port(also=0) -> int`: a TCP port free on 127.0.0.1 just now (another process may take
it before the caller binds it); with `also`, one whose port + `also` is free too (a Redis
cluster bus, the Prometheus ports of a second rank)."""

from __future__ import annotations

import socket


def free_port(also: int = 0) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not also:
            return port
        if port + also <= 65535:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port + also))
                except OSError:
                    continue
            return port
