"""Distributed setup, in one function: gloo on CPU, NCCL on GPU."""

from __future__ import annotations

import contextlib
import os
import random
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = [
    "CPU_AND_CUDA",
    "default_backend",
    "free_port",
    "init_distributed",
    "interface_towards",
    "reserve_port",
]

CPU_AND_CUDA = "cpu:gloo,cuda:nccl"
"""A process group with NCCL for CUDA tensors and gloo for CPU ones (FSDP2 with CPU offload reduces
CPU-resident gradient shards)."""


def default_backend() -> str:
    """``nccl`` when CUDA is present, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (see :func:`reserve_port` for one that stays
    free until it is used), chosen below the kernel's ephemeral range when one is free there: a client
    that keeps retrying a connect to a port inside that range can be given the same port as its own source
    port (a TCP self-connect), after which the server cannot bind it. Ports below 20000 are avoided too:
    Ray's workers take 10002-19999 by default (``ray start`` refuses a ``--port`` in that range)."""
    with _bound_socket(host) as s:
        return s.getsockname()[1]


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket already listening on ``host``, at a port chosen as :func:`free_port` chooses one:
    the port stays this process's from the moment it is chosen, so no other process can take it before a
    store serves on it (pass the socket as ``listener`` to :func:`init_distributed`); its port is
    ``getsockname()[1]``. Peers that connect before then wait in its backlog."""
    s = _bound_socket(host)
    s.listen(128)
    return s


def _bound_socket(host: str) -> socket.socket:
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(20000, low) if low > 20000 else rng.randrange(1024, low)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((host, port))
        except OSError:
            s.close()
            continue
        return s
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # all taken: any free port
    s.bind((host, 0))
    return s


def init_distributed(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
    listener: socket.socket | None = None,
) -> tuple[int, int]:
    """Join the default process group (adopted by DeepSpeed) and return ``(rank, world_size)``.

    Arguments override ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``; with none of them
    set, a single process joins a group of one on 127.0.0.1 and a free port. ``backend``: gloo on CPU,
    nccl on GPU by default, or :data:`CPU_AND_CUDA` (torch's group alone, not DeepSpeed's). On CPU the backend is gloo
    and DeepSpeed's shared-memory communication op is switched off first (otherwise DeepSpeed
    JIT-compiles it for minutes and needs a compiler). Every collective gets ``timeout_s``, so a dead
    peer raises instead of hanging. Calling it again in an initialised process is a no-op.
    ``listener``: rank 0's socket from :func:`reserve_port`, which the rendezvous store then serves on
    (``master_addr`` and ``master_port`` default to its address; it is closed if refused); without it rank 0
    binds ``master_port``.

    Side effect, on purpose: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
    are written to ``os.environ`` (from the arguments, else the defaults above), because DeepSpeed and
    torch's ``env://`` rendezvous read them there; nothing else in the environment is changed.
    """
    if listener is not None:
        master_addr, master_port = _check_listener(listener, rank, master_addr, master_port)
    if dist.is_initialized():
        if listener is not None:
            listener.close()
        return dist.get_rank(), dist.get_world_size()
    _set_rendezvous_env(rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port)
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl", CPU_AND_CUDA):
        raise ValueError(f"backend: expected 'gloo', 'nccl' or {CPU_AND_CUDA!r}, got {backend!r}")
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if backend == CPU_AND_CUDA:  # (DeepSpeed takes one backend name: the group is torch's alone)
        _join_bound_to_master(backend, timedelta(seconds=timeout_s), listener)
        return dist.get_rank(), dist.get_world_size()

    import deepspeed
    import deepspeed.ops

    if backend == "gloo":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    _join_bound_to_master(backend, timedelta(seconds=timeout_s), listener)
    deepspeed.init_distributed(  # adopts the group just made
        dist_backend=backend,
        auto_mpi_discovery=False,
        verbose=False,
        timeout=timedelta(seconds=timeout_s),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    return dist.get_rank(), dist.get_world_size()


def _check_listener(
    listener: socket.socket, rank: int | None, addr: str | None, port: int | None
) -> tuple[str, int]:
    """The rendezvous address ``listener`` serves (``addr`` / ``port`` default to its own); ValueError, the
    listener closed, when it is not rank 0's or listens elsewhere."""
    host, bound = listener.getsockname()[:2]
    addr, port = addr or host, port or bound
    problem = None
    if (rank if rank is not None else int(os.environ.get("RANK", "0"))) != 0:
        problem = "only rank 0 serves the rendezvous store"
    elif (addr, port) != (host, bound):
        problem = f"listens on {host}:{bound}, not {addr}:{port}"
    if problem:
        listener.close()
        raise ValueError(f"listener: {problem}")
    return addr, port


def _join_bound_to_master(backend: str, timeout: timedelta, listener: socket.socket | None) -> None:
    """The default process group, its rendezvous store listening on ``MASTER_ADDR`` only (torch's own
    store listens on every interface): rank 0 binds the socket and hands it to the store. Gloo's
    connections are made on the interface that reaches ``MASTER_ADDR`` (``interface_towards``) unless
    ``GLOO_SOCKET_IFNAME`` is set."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    fd = None
    if rank == 0:
        fd = listener.detach() if listener is not None else _listening_fd(addr, port)
    store = dist.TCPStore(addr, port, world, rank == 0, timeout, master_listen_fd=fd)
    if "gloo" in backend and "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = interface_towards(addr)
        if iface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


def interface_towards(addr: str) -> str | None:
    """The network interface this host reaches ``addr`` through (``lo`` for a loopback address; for one
    of this host's own, the interface that holds it):
    gloo's connections are made there. Left to itself, gloo binds the address this host's name resolves
    to, which need not be on the link to the other ranks (a host whose name maps to 127.0.0.1 would
    offer its peers a loopback address). None when it cannot be told."""
    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(addr), 9))  # picks a route; sends nothing
            local = probe.getsockname()[0]
    except OSError:
        return None
    if local.startswith("127."):
        return next((name for _, name in socket.if_nameindex() if name == "lo"), None)
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addresses):
            return name
    return None


def _listening_fd(addr: str, port: int) -> int:
    """A TCP socket listening on ``addr:port`` only, as a file descriptor the store takes over."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, port))
        listener.listen(128)
        return listener.detach()  # the store owns it now: closing the Python object must not close it


def _set_rendezvous_env(
    *, rank: int | None, world_size: int | None, master_addr: str | None, master_port: int | None
) -> None:
    """Write ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` to
    ``os.environ``: the arguments where given, else what is there, else single-process defaults."""
    env = {
        "RANK": rank,
        "LOCAL_RANK": rank if os.environ.get("LOCAL_RANK") is None else None,
        "WORLD_SIZE": world_size,
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
    }
    for key, value in env.items():
        if value is not None:
            os.environ[key] = str(value)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if os.environ["WORLD_SIZE"] != "1":
            raise ValueError("master_port: needed (or MASTER_PORT) when world_size > 1")
        os.environ["MASTER_PORT"] = str(free_port())
