"""Networking helpers for tests that start servers or process groups on this machine."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago, chosen below the kernel's ephemeral range when
    one is free there: a client that keeps retrying a connect to a port inside that range can be given
    the same port as its own source port (a TCP self-connect), after which the server cannot bind it.
    Ports below 20000 are avoided too: Ray's workers take 10002-19999 by default (``ray start`` refuses
    a ``--port`` in that range)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(20000, low) if low > 20000 else rng.randrange(1024, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all taken: any free port
        s.bind((host, 0))
        return s.getsockname()[1]
