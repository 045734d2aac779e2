"""``shm``: buckets handed over in a shared-memory segment (CPU, sender and receivers on one host).

The segment holds a ring of :data:`NUM_SLOTS` bucket slots (see ``_shmfile.py`` for how it is
created, shared and unlinked). The sender packs each bucket directly into a slot (the only copy on
its side) and receivers read tensors as views of the slot (no copy until their load callback
copies into the model). Slot handshakes are sequence numbers in shared memory (see ``_slots.py``);
no bytes go through a socket.
"""

from __future__ import annotations

import torch

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync._shmfile import share_file
from rlhf_weightsync._slots import SlotTransport

__all__ = ["NUM_SLOTS", "connect"]

NUM_SLOTS = 4
"""Slots in the ring: with the default 4 MiB buckets a 16 MiB segment, in which sender and receiver
drift apart by up to three buckets without waiting for each other. Smaller buckets (1-2 MiB, more
slots) measured slower in ``benchmarks/weightsync_cpu.py``: per-bucket hand-off costs outweigh the
cache gains."""


def connect(rdv: Rendezvous, *, bucket_bytes: int, device: torch.device | None) -> SlotTransport:
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"device: the shm transport moves CPU buffers, got {device}")
    flat = share_file(rdv, "buckets", NUM_SLOTS * bucket_bytes)  # receivers map the sender's size
    slots = list(flat.view(-1, bucket_bytes).unbind(0))
    return SlotTransport(name="shm", rdv=rdv, slots=slots, device=torch.device("cpu"))
