"""The one protocol every transport implements, and the registry that opens them by name.

A transport moves opaque byte buckets from rank 0 to every other rank of the group, in order.
The sender and receivers (``sender.py``, ``receiver.py``) own everything else: layout, packing,
checksums, the manifest and acknowledgements (through the rendezvous store).

Sender side, per sync: ``begin(sync, sizes)``, then for each bucket ``i``: ``buf = acquire(i)``
(a uint8 buffer of ``sizes[i]`` bytes to pack into, possibly shared memory or a GPU buffer; blocks
until the slot is free again), ``post(i)``; finally ``flush()`` (every bucket delivered and released).
Receiver side, per sync: ``begin(sync, sizes)``, then for each bucket ``i``: ``buf = wait(i)``
(the bucket's bytes, valid until ``release(i)``), ``release(i)``. Every blocking call raises
:class:`~rlhf_weightsync.errors.WeightSyncError` (or its ``PeerTimeoutError``) naming the bucket and
the peers instead of hanging past ``timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol, get_args

import torch

from rlhf_weightsync._rendezvous import Rendezvous

__all__ = ["TRANSPORTS", "Tamper", "Transport", "TransportName", "open_transport"]

TransportName = Literal["gloo", "shm", "nccl", "cuda_ipc"]
TRANSPORTS: tuple[str, ...] = get_args(TransportName)

Tamper = Callable[[int, torch.Tensor], None]
"""Fault-injection hook ``(bucket_index, received_bytes) -> None``, for tests: a receiver's transport
calls it on each bucket as it arrives, before any checksum is verified."""


class Transport(Protocol):
    name: str
    device: torch.device
    tamper: Tamper | None

    def begin(self, sync: int, sizes: Sequence[int]) -> None: ...

    def acquire(self, index: int) -> torch.Tensor: ...

    def post(self, index: int) -> None: ...

    def flush(self) -> None: ...

    def wait(self, index: int) -> torch.Tensor: ...

    def release(self, index: int) -> None: ...

    def close(self) -> None: ...


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
