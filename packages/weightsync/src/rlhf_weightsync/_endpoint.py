"""What the sender and a receiver share: their rendezvous and transport, and closing both once."""

from __future__ import annotations

from typing import Self

import torch

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.protocol import TRANSPORTS, Transport, TransportName
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
        self._sync = 0
        self._closed = False
        self._broken: str | None = None

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
