"""Shared machinery of the memory-sharing transports (``shm``, ``cuda_ipc``): slots plus store handshakes.

The sender owns ``num_slots`` buffers that every receiver has mapped. Bucket ``i`` lives in slot
``i % num_slots``. The sender packs it in place and sets ``ready/i`` in the rendezvous store; each
receiver waits for that key, reads the bucket where it lies (no copy), and sets ``consumed/i/rank``
when its load callback is done; the sender waits for all of those before it packs bucket
``i + num_slots`` into the same slot. With two slots, packing one bucket overlaps loading the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.errors import WeightSyncError
from rlhf_weightsync.transport import Tamper

__all__ = ["SlotTransport"]


class SlotTransport:
    """Buckets handed over in place through ``slots`` (flat uint8 buffers, one per slot)."""

    def __init__(
        self,
        *,
        name: str,
        rdv: Rendezvous,
        slots: list[torch.Tensor],
        device: torch.device,
        fence: Callable[[], None] = lambda: None,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self.name, self.device = name, device
        self.tamper: Tamper | None = None
        self._rdv, self._slots, self._fence, self._on_close = rdv, slots, fence, on_close
        self._sync, self._sizes = -1, []
        self._pending: list[int] = []  # sender: posted buckets not yet consumed by everyone

    def _key(self, what: str, index: int) -> str:
        return f"{self.name}/{self._sync}/{what}/{index}"

    def begin(self, sync: int, sizes: Sequence[int]) -> None:
        capacity = self._slots[0].numel() if self._slots else 0
        too_big = [i for i, n in enumerate(sizes) if n > capacity]
        if too_big:
            raise WeightSyncError(
                f"{self.name}: bucket {too_big[0]} needs {sizes[too_big[0]]} bytes, but the slots hold {capacity}"
            )
        self._sync, self._sizes, self._pending = sync, list(sizes), []

    # sender
    def acquire(self, index: int) -> torch.Tensor:
        if index >= len(self._slots):
            self._consumed(index - len(self._slots))
        return self._slots[index % len(self._slots)][: self._sizes[index]]

    def post(self, index: int) -> None:
        self._fence()  # the bytes must be in the slot before anyone is told
        self._rdv.set(self._key("ready", index))
        self._pending.append(index)

    def flush(self) -> None:
        while self._pending:
            self._consumed(self._pending[0])

    def _consumed(self, index: int) -> None:
        prefix = self._key("consumed", index)
        self._rdv.wait_ranks(
            prefix,
            self._rdv.receivers,
            what=f"{self.name}: receivers to consume bucket {index + 1}/{len(self._sizes)} of sync {self._sync}",
        )
        self._pending.remove(index)
        self._rdv.delete([self._key("ready", index), *(f"{prefix}/{r}" for r in self._rdv.receivers)])

    # receiver
    def wait(self, index: int) -> torch.Tensor:
        self._rdv.wait(
            [(self._key("ready", index), 0)],
            what=f"{self.name}: the sender's bucket {index + 1}/{len(self._sizes)} of sync {self._sync}",
        )
        buf = self._slots[index % len(self._slots)][: self._sizes[index]]
        if self.tamper is not None:
            self.tamper(index, buf)
        return buf

    def release(self, index: int) -> None:
        self._fence()  # reads of the slot must be finished before the sender may overwrite it
        self._rdv.set(f"{self._key('consumed', index)}/{self._rdv.rank}")

    def close(self) -> None:
        self._slots = []
        self._on_close()
