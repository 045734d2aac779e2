"""The factory that opens a transport by name. The contract the transports implement is in
:mod:`rlhf_weightsync.protocol`; this is the one module that imports the concrete transports."""

from __future__ import annotations

import torch

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.protocol import TRANSPORTS, Transport

__all__ = ["open_transport"]


def open_transport(
    name: str, rdv: Rendezvous, *, bucket_bytes: int, device: torch.device | None
) -> Transport:
    """Open transport ``name`` over a joined rendezvous (a collective call: all ranks must call it)."""
    if name == "gloo":
        from rlhf_weightsync.gloo import connect
    elif name == "shm":
        from rlhf_weightsync.shm import connect
    elif name == "nccl":
        from rlhf_weightsync.nccl import connect
    elif name == "cuda_ipc":
        from rlhf_weightsync.cuda_ipc import connect
    else:
        raise ValueError(f"transport: unknown {name!r}; expected one of {TRANSPORTS}")
    return connect(rdv, bucket_bytes=bucket_bytes, device=device)
