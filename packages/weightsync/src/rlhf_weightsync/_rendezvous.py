"""The private control plane: a TCPStore hosted by the sender (rank 0), plus a join handshake.

Nothing here touches ``torch.distributed``'s default group. Every wait has a timeout, and a timeout
names the ranks that did not answer and, for peers on this host, whether their process still exists.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist

from rlhf_weightsync.errors import PeerTimeoutError, WeightSyncError

__all__ = ["Rendezvous"]

_PREFIX = "rlhf_weightsync"
POLL_S = 1.0


def _alive(pid: int) -> bool:
    """Whether process ``pid`` on this host exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


class Rendezvous:
    """Connects rank ``rank`` of ``world_size`` through a TCPStore at ``master_addr:master_port``.

    Rank 0 (the sender) hosts the store and waits (at most ``connect_timeout_s``, default
    ``timeout_s``) until every receiver has joined; receivers wait as long for the sender. ``info`` is published to the peers (the sender's includes the transport name and
    bucket size, which receivers check and adopt).
    """

    def __init__(
        self,
        *,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        connect_timeout_s: float | None = None,
        info: dict,
        listener: socket.socket | None = None,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError(
                f"world_size: expected an int >= 2 (one sender and receivers), got {world_size!r}"
            )
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank!r}")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s: expected a finite positive number of seconds, got {timeout_s!r}")
        connect_timeout_s = timeout_s if connect_timeout_s is None else connect_timeout_s
        if not (connect_timeout_s > 0 and math.isfinite(connect_timeout_s)):
            raise ValueError(
                f"connect_timeout_s: expected a finite positive number of seconds, got {connect_timeout_s!r}"
            )
        if not isinstance(master_port, int) or not 0 < master_port < 65536:
            raise ValueError(f"master_port: expected a TCP port number, got {master_port!r}")
        self.master_addr, self.master_port = master_addr, master_port
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        try:
            raw = dist.TCPStore(
                master_addr,
                master_port,
                None,
                rank == 0,
                timedelta(seconds=max(timeout_s, connect_timeout_s)),
                wait_for_workers=False,
                master_listen_fd=_listen_fd(master_addr, master_port, listener) if rank == 0 else None,
            )
        except Exception as exc:
            verb = "serve" if rank == 0 else "reach"
            raise WeightSyncError(
                f"rank {rank}: cannot {verb} the weight-sync store at {master_addr}:{master_port}: {exc}"
            ) from exc
        self._raw = raw
        self.store = dist.PrefixStore(_PREFIX, raw)
        self._waiter: _SenderKeyWaiter | None = None
        self.info = {**info, "pid": os.getpid(), "host": socket.gethostname()}
        self.peers: dict[int, dict] = {}
        self.set(f"join/{rank}", json.dumps(self.info).encode())
        if rank == 0:
            self.wait_ranks("join", self.receivers, what="join the sync group", timeout_s=connect_timeout_s)
            for r in self.receivers:
                self.peers[r] = json.loads(self.get(f"join/{r}"))
        else:
            self.wait([("join/0", 0)], what="the sender to join the sync group", timeout_s=connect_timeout_s)
            self.peers[0] = json.loads(self.get("join/0"))
        self._check_transports()

    @property
    def receivers(self) -> range:
        return range(1, self.world_size)

    @property
    def sender_info(self) -> dict:
        return self.info if self.rank == 0 else self.peers[0]

    def _check_transports(self) -> None:
        mine = self.info.get("transport")
        for r, peer in self.peers.items():
            if peer.get("transport") != mine:
                raise ValueError(
                    f"transport: rank {self.rank} uses {mine!r} but rank {r} uses {peer.get('transport')!r}"
                )

    # -- store helpers -------------------------------------------------------------------------

    def set(self, key: str, value: bytes = b"") -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        try:
            return self.store.get(key)
        except Exception as exc:
            raise WeightSyncError(
                f"rank {self.rank}: lost the weight-sync store reading {key!r}: {exc}"
            ) from exc

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            try:
                self.store.delete_key(key)
            except Exception:  # the store is going away; stale keys die with it
                return

    def wait(self, keys: list[tuple[str, int]], *, what: str, timeout_s: float | None = None) -> None:
        """Wait until every ``(key, rank_that_sets_it)`` exists; PeerTimeoutError names the missing ranks.

        A receiver waiting for keys of the sender blocks in the store's own ``wait`` (in a thread, on
        a connection of its own: it wakes the moment the key is set, and the sender hosting the store,
        its death breaks the connection). Other waits poll the store (with a back-off from 0.1 ms to
        2 ms during the first second, then to 50 ms). Either way, every ``POLL_S`` seconds the wait
        checks whether a missing peer on this host has exited: a dead peer fails the wait at once
        instead of at the timeout.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout_s: expected a finite positive number of seconds, got {timeout_s!r}")
        if self.rank != 0 and all(r == 0 for _, r in keys) and self._blocking_wait(keys, what, timeout):
            return
        names = [k for k, _ in keys]
        t0 = time.monotonic()
        deadline, next_check, delay = t0 + timeout, t0 + POLL_S, 1e-4
        while True:
            try:
                if self.store.check(names):
                    return
                now = time.monotonic()
                if now < next_check and now < deadline:
                    time.sleep(delay)
                    delay = min(2 * delay, 2e-3 if now - t0 < 1.0 else 5e-2)
                    continue
                missing = sorted({r for k, r in keys if not self.store.check([k])})
            except Exception as exc:
                raise WeightSyncError(
                    f"rank {self.rank}: lost the weight-sync store while waiting for {what}: {exc}"
                ) from exc
            self.raise_if_gone(missing, what=what, waited=now - t0, timeout=timeout, final=now >= deadline)
            next_check = now + POLL_S

    def _blocking_wait(self, keys: list[tuple[str, int]], what: str, timeout: float) -> bool:
        """Wait in the store's blocking ``wait``; False if that is not possible now (then poll instead)."""
        if self._waiter is None:
            try:
                self._waiter = _SenderKeyWaiter(dist.PrefixStore(_PREFIX, self._raw.clone()))
            except Exception:  # a store without clone(): poll
                return False
        if self._waiter.busy:  # still blocked in a wait that an interrupt or error abandoned: poll
            return False
        t0 = time.monotonic()
        done, result = self._waiter.start([k for k, _ in keys], t0 + timeout)
        while not done.wait(POLL_S):
            # The sender's process may be gone while its socket lives on (e.g. in a forked child).
            now = time.monotonic()
            self.raise_if_gone(
                [0], what=what, waited=now - t0, timeout=timeout, final=now > t0 + timeout + POLL_S
            )
        error = result[0]
        if error is None:
            return True
        waited = time.monotonic() - t0
        if isinstance(error, dist.DistStoreError) and "timeout" in str(error).lower():
            self.raise_if_gone([0], what=what, waited=waited, timeout=timeout, final=True)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise WeightSyncError(
            f"rank {self.rank}: lost the weight-sync store while waiting for {what} after {waited:.1f} s "
            f"(the sender's process hosts it): {first_line}; sender: {self.describe([0])}"
        ) from error

    def raise_if_gone(
        self, missing: list[int], *, what: str, waited: float, timeout: float, final: bool
    ) -> None:
        """Raise PeerTimeoutError for ``missing`` ranks if ``final`` or if one of them has exited."""
        if missing and (final or any(self.exited(r) for r in missing)):
            raise PeerTimeoutError(
                f"rank {self.rank}: waited {waited:.1f} s (timeout {timeout:.1f} s) for {what}; "
                f"no answer from {self.describe(missing)}"
            )

    def wait_ranks(
        self, prefix: str, ranks: Iterable[int], *, what: str, timeout_s: float | None = None
    ) -> None:
        self.wait([(f"{prefix}/{r}", r) for r in ranks], what=what, timeout_s=timeout_s)

    def describe(self, ranks: Iterable[int]) -> str:
        """``"rank 2 (pid 123 on this host, no longer running)"`` and the like."""
        return ", ".join(self._describe(r) for r in ranks)

    def exited(self, rank: int) -> bool:
        """Whether ``rank`` runs on this host and its process is gone."""
        peer = self.peers.get(rank)
        return peer is not None and peer["host"] == socket.gethostname() and not _alive(peer["pid"])

    def _describe(self, rank: int) -> str:
        peer = self.peers.get(rank)
        if peer is None:
            return f"rank {rank} (never joined)"
        where = f"pid {peer['pid']} on {peer['host']}"
        if peer["host"] != socket.gethostname():
            return f"rank {rank} ({where})"
        return f"rank {rank} ({where}, {'still running' if _alive(peer['pid']) else 'no longer running'})"

    def close(self) -> None:
        self.store = None  # type: ignore[assignment]
        self._raw = None
        self._waiter = None


class _SenderKeyWaiter:
    """Runs the store's blocking ``wait`` in a daemon thread on its own store connection, so that the
    caller keeps control (liveness checks, Ctrl-C) while the thread sleeps until the key is set. A
    wait the caller abandoned ends at its deadline or when the store goes away."""

    MAX_CHUNK_S = 86400.0  # one store wait at most a day long (huge values overflow inside the store)

    def __init__(self, store: dist.Store) -> None:
        self._store = store
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, names: list[str], deadline: float) -> tuple[threading.Event, list[BaseException | None]]:
        """Start waiting for ``names`` until ``deadline`` (``time.monotonic()``); ``done`` is set when
        the wait ends, with ``result[0]`` None (the keys exist) or the store's exception."""
        done = threading.Event()
        result: list[BaseException | None] = [None]

        def run() -> None:
            try:
                while True:
                    left = deadline - time.monotonic()
                    try:
                        self._store.wait(names, timedelta(seconds=max(min(left, self.MAX_CHUNK_S), 1e-3)))
                        return
                    except dist.DistStoreError as exc:
                        if "timeout" not in str(exc).lower() or time.monotonic() >= deadline:
                            raise
            except BaseException as exc:
                result[0] = exc
            finally:
                done.set()

        self._thread = threading.Thread(target=run, name="rlhf-weightsync-wait", daemon=True)
        self._thread.start()
        return done, result


def _listen_fd(addr: str, port: int, listener: socket.socket | None) -> int:
    """The store's listening socket as a file descriptor: ``listener``'s (checked to be on ``addr:port``),
    else a new one."""
    if listener is None:
        return _listening_fd(addr, port)
    host, bound = listener.getsockname()[:2]
    if (host, bound) != (socket.gethostbyname(addr), port):
        raise ValueError(f"listener: listens on {host}:{bound}, not {addr}:{port}")
    return listener.detach()


def _listening_fd(addr: str, port: int) -> int:
    """A TCP socket listening on ``addr:port`` only (torch's store would listen on every interface), as a
    file descriptor the store takes over."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((addr, port))
        listener.listen(128)
        return listener.detach()  # the store owns it now
