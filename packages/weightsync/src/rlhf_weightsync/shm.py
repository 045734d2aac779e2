"""``shm``: buckets handed over in a shared-memory segment (CPU, sender and receivers on one host).

The segment holds two bucket slots (see ``_shmfile.py`` for how it is created, shared and unlinked).
The sender packs each bucket directly into a slot (the only copy on its side) and receivers read
tensors as views of the slot (no copy until their load callback copies into the model). Slot
handshakes are sequence numbers in shared memory (see ``_slots.py``); no bytes go through a socket.
"""

from __future__ import annotations

import torch

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync._shmfile import share_file
from rlhf_weightsync._slots import NUM_SLOTS, SlotTransport

__all__ = ["connect"]


def connect(rdv: Rendezvous, *, bucket_bytes: int, device: torch.device | None) -> SlotTransport:
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"device: the shm transport moves CPU buffers, got {device}")
    flat = share_file(rdv, "buckets", NUM_SLOTS * bucket_bytes)
    slots = list(flat.view(NUM_SLOTS, bucket_bytes).unbind(0))
    return SlotTransport(name="shm", rdv=rdv, slots=slots, device=torch.device("cpu"))
