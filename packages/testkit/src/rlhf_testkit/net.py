"""Networking helpers for tests that start servers or process groups on this machine."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (another process may still take it first)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
