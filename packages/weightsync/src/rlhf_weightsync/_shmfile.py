"""A file in shared memory that the sender creates and every receiver maps (same host only)."""

from __future__ import annotations

import json
import os
import socket
import uuid

import torch

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.errors import WeightSyncError

__all__ = ["share_file"]


def _map(path: str, nbytes: int) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(path, True, nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def share_file(rdv: Rendezvous, name: str, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor of ``nbytes`` mapped from the same shared-memory file on every rank.

    Collective. The sender creates the file in ``/dev/shm`` (or ``$RLHF_WEIGHTSYNC_SHM_DIR``), writes
    zeros to every page (so no page is first allocated during a sync), publishes its path, waits
    until every receiver has mapped it and unlinks it: the mappings stay valid and nothing is left
    behind when a process dies.
    """
    key = f"shmfile/{name}"
    if rdv.rank == 0:
        folder = os.environ.get("RLHF_WEIGHTSYNC_SHM_DIR", "/dev/shm")
        stat = os.statvfs(folder)
        if stat.f_bavail * stat.f_frsize < nbytes:
            raise WeightSyncError(
                f"shm: {folder} has {stat.f_bavail * stat.f_frsize} bytes free, {name} needs {nbytes}; "
                "lower bucket_bytes or set RLHF_WEIGHTSYNC_SHM_DIR"
            )
        path = os.path.join(folder, f"rlhf_weightsync_{os.getpid()}_{name}_{uuid.uuid4().hex[:12]}")
        try:
            flat = _map(path, nbytes)
            flat.zero_()
            rdv.set(key, json.dumps({"path": path, "nbytes": nbytes}).encode())
            rdv.wait_ranks(
                f"{key}/mapped", rdv.receivers, what=f"receivers to map the shared-memory file {name}"
            )
        finally:
            if os.path.exists(path):
                os.unlink(path)
        return flat
    if rdv.sender_info["host"] != socket.gethostname():
        raise ValueError(
            f"transport {rdv.info.get('transport')!r} needs sender and receivers on one host; the sender is "
            f"on {rdv.sender_info['host']!r}, rank {rdv.rank} on {socket.gethostname()!r}"
        )
    rdv.wait([(key, 0)], what=f"the sender's shared-memory file {name}")
    doc = json.loads(rdv.get(key))
    if not os.path.exists(doc["path"]):
        raise WeightSyncError(f"rank {rdv.rank}: shared-memory file {doc['path']} is gone (sender failed?)")
    flat = _map(doc["path"], doc["nbytes"])
    rdv.set(f"{key}/mapped/{rdv.rank}")
    return flat
