"""What a process tree listens on: the sockets of a command and all its descendants, sampled while it
runs (a server that lives for a second is caught by sampling often enough)."""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass

import psutil

__all__ = ["ListeningSocket", "SocketWatcher", "is_loopback", "listening_sockets", "process_tree"]


@dataclass(frozen=True)
class ListeningSocket:
    ip: str
    port: int
    pid: int
    name: str
    protocol: str = "tcp"
    """``tcp`` (a socket in LISTEN state) or ``udp`` (a bound socket with no peer: it takes datagrams)."""

    @property
    def loopback(self) -> bool:
        return is_loopback(self.ip)


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4 loopback address mapped into IPv6 (``::ffff:127.0.0.1``)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its living descendants (empty when ``pid`` is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def listening_sockets(pid: int) -> set[ListeningSocket]:
    """The sockets of ``pid``'s process tree that others can reach, now: TCP in LISTEN state, and UDP
    bound without a peer."""
    import socket

    found = set()
    for proc in process_tree(pid):
        try:
            name = proc.name()
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for c in conns:
            udp = c.type == socket.SOCK_DGRAM and not c.raddr
            if (c.status == psutil.CONN_LISTEN or udp) and c.laddr:
                kind = "udp" if udp else "tcp"
                found.add(
                    ListeningSocket(ip=c.laddr.ip, port=c.laddr.port, pid=proc.pid, name=name, protocol=kind)
                )
    return found


class SocketWatcher:
    """Samples :func:`listening_sockets` of ``pid`` every ``interval_s`` on a thread while in its ``with``
    block; ``seen`` is every socket observed."""

    def __init__(self, pid: int, *, interval_s: float = 0.5) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.seen: set[ListeningSocket] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen |= listening_sockets(self.pid)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> SocketWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
