"""``gloo``: buckets broadcast over a private gloo process group (CPU tensors, any hosts).

The group is built from the rendezvous store (``ProcessGroupGloo(store, rank, size, options)``),
never from ``torch.distributed``'s default group, with the sync timeout on every operation. The
gloo network interface follows ``GLOO_SOCKET_IFNAME`` when set; with a loopback ``master_addr`` all
ranks use 127.0.0.1. The group gets two gloo devices (two connection sets, two worker threads), so
the broadcast of bucket ``i + 1`` can run while bucket ``i``'s finishes.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from rlhf_weightsync._collective import BroadcastTransport
from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.errors import WeightSyncError

__all__ = ["connect"]


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return False


def _device(master_addr: str):
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if iface:
        return dist.ProcessGroupGloo.create_device(interface=iface.split(",")[0])
    if _is_loopback(master_addr):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def connect(rdv: Rendezvous, *, bucket_bytes: int, device: torch.device | None) -> BroadcastTransport:
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"device: the gloo transport moves CPU buffers, got {device}")
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=rdv.timeout_s)
    opts._devices = [_device(rdv.master_addr), _device(rdv.master_addr)]
    opts._threads = 2
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", rdv.store), rdv.rank, rdv.world_size, opts)
    except Exception as exc:
        others = rdv.receivers if rdv.rank == 0 else [0]
        raise WeightSyncError(
            f"gloo: rank {rdv.rank} could not connect the group: {exc}; peers: {rdv.describe(others)}"
        ) from exc
    return BroadcastTransport(name="gloo", pg=pg, rdv=rdv, device=torch.device("cpu"))
