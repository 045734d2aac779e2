"""``shm``: buckets handed over in a shared-memory segment (CPU, sender and receivers on one host).

The sender creates a file of ``num_slots * bucket_bytes`` bytes in ``/dev/shm`` (or
``$RLHF_WEIGHTSYNC_SHM_DIR``), maps it, touches every page once, and publishes its path through the
rendezvous store; receivers map the same file, and once all have, the sender unlinks it (the
mappings stay valid, and nothing is left behind if a process dies). The sender packs each bucket
directly into a slot (the only copy on its side) and receivers read tensors as views of the slot (no
copy until their load callback copies into the model). Handshakes: see ``_slots.py``.
"""

from __future__ import annotations

import json
import os
import socket
import uuid

import torch

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync._slots import SlotTransport
from rlhf_weightsync.errors import WeightSyncError

__all__ = ["NUM_SLOTS", "connect"]

NUM_SLOTS = 2


def _map(path: str, nbytes: int) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(path, True, nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def connect(rdv: Rendezvous, *, bucket_bytes: int, device: torch.device | None) -> SlotTransport:
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"device: the shm transport moves CPU buffers, got {device}")
    nbytes = NUM_SLOTS * bucket_bytes
    if rdv.rank == 0:
        folder = os.environ.get("RLHF_WEIGHTSYNC_SHM_DIR", "/dev/shm")
        stat = os.statvfs(folder)
        if stat.f_bavail * stat.f_frsize < nbytes:
            raise WeightSyncError(
                f"shm: {folder} has {stat.f_bavail * stat.f_frsize} bytes free, the segment needs {nbytes} "
                f"({NUM_SLOTS} slots of bucket_bytes={bucket_bytes}); lower bucket_bytes or set RLHF_WEIGHTSYNC_SHM_DIR"
            )
        path = os.path.join(folder, f"rlhf_weightsync_{os.getpid()}_{uuid.uuid4().hex[:12]}")
        try:
            flat = _map(path, nbytes)
            flat.zero_()  # allocate the pages now, not during the first sync
            rdv.set("shm/segment", json.dumps({"path": path, "nbytes": nbytes}).encode())
            rdv.wait_ranks("shm/mapped", rdv.receivers, what="receivers to map the shared-memory segment")
        finally:
            if os.path.exists(path):
                os.unlink(path)
    else:
        if rdv.sender_info["host"] != socket.gethostname():
            raise ValueError(
                f"transport 'shm' needs sender and receivers on one host; the sender is on "
                f"{rdv.sender_info['host']!r}, rank {rdv.rank} on {socket.gethostname()!r} (use 'gloo')"
            )
        rdv.wait([("shm/segment", 0)], what="the sender's shared-memory segment")
        seg = json.loads(rdv.get("shm/segment"))
        if not os.path.exists(seg["path"]):
            raise WeightSyncError(f"shm: rank {rdv.rank}: segment {seg['path']} is gone (sender failed?)")
        flat = _map(seg["path"], seg["nbytes"])
        rdv.set(f"shm/mapped/{rdv.rank}")
    slots = list(flat.view(NUM_SLOTS, bucket_bytes).unbind(0))
    return SlotTransport(name="shm", rdv=rdv, slots=slots, device=torch.device("cpu"))
