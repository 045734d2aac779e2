"""What the sender and a receiver share: their rendezvous and transport, and closing both once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Self

import torch

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.protocol import TRANSPORTS, Transport, TransportName
from rlhf_weightsync.selection import CPU_TRANSPORTS
from rlhf_weightsync.transport import open_transport

__all__ = ["Endpoint", "check_transport_name"]


def check_transport_name(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: unknown {transport!r}; expected one of {TRANSPORTS}")


class Endpoint:
    """One side of a sync group. ``_sync`` counts the syncs done; ``_broken`` says why the side is
    out of step with the others (every later sync refuses to start)."""

    def _open(
        self,
        transport: TransportName,
        rdv: Rendezvous,
        *,
        bucket_bytes: int,
        device: torch.device | str | None,
    ) -> None:
        self._rdv = rdv
        try:
            self._transport = open_transport(transport, rdv, bucket_bytes=bucket_bytes, device=device)
        except BaseException:
            rdv.close()  # the sender would keep its store's port bound
            raise
        self._cpu = transport in CPU_TRANSPORTS
        self._sync = 0
        self._closed = False
        self._broken: str | None = None

    @contextlib.contextmanager
    def _sync_threads(self) -> Iterator[None]:
        """Torch's intra-op threads at one during a CPU sync. The sender and its receivers copy and
        checksum at the same time, each with the threads its process was given for other work; on shared
        cores a second thread per side oversubscribes them, and each parallel copy then waits for a thread
        that is not running (a 23M-parameter sync on 2 cores: see the package README). ``torch.set_num_threads``
        is process-wide: other threads of the process that start parallel work during a sync get one
        thread too."""
        before = torch.get_num_threads()
        if not self._cpu or before == 1:
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    @property
    def transport(self) -> Transport:
        """The underlying transport (exposed for inspection and fault injection in tests)."""
        return self._transport

    def close(self) -> None:
        """Release the transport and the rendezvous (the sender stops hosting it: receivers waiting on
        it then fail). Idempotent."""
        if not self._closed:
            self._closed = True
            try:
                self._transport.close()
            finally:
                self._rdv.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
