"""The transport contract: what every transport implements, and the names they go by.

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

This module imports nothing from the package: transports import it, and only the factory
(``transport.py``) imports the transports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol, get_args

import torch

__all__ = ["TRANSPORTS", "Tamper", "Transport", "TransportName"]

TransportName = Literal["gloo", "shm", "nccl", "cuda_ipc"]
TRANSPORTS: tuple[TransportName, ...] = get_args(TransportName)

Tamper = Callable[[int, torch.Tensor], None]
"""Fault-injection hook ``(bucket_index, received_bytes) -> None``, for tests: a receiver's transport
calls it on each bucket as it arrives, before any checksum is verified."""


class Transport(Protocol):
    """One side of an open transport (see the module docstring for the call order)."""

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
