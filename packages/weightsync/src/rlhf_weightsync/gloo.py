"""``gloo``: buckets broadcast over a private gloo process group (CPU tensors, any hosts).

The group is built from the rendezvous store (``ProcessGroupGloo(store, rank, size, options)``),
never from ``torch.distributed``'s default group, with the sync timeout on every operation. The
gloo network interface follows ``GLOO_SOCKET_IFNAME`` when set; otherwise each rank binds its address
on the route to ``master_addr`` (127.0.0.1 with a loopback master; across hosts, the link between them,
whatever this host's name resolves to). The group gets two gloo devices (two connection sets, two worker threads), so
the broadcast of bucket ``i + 1`` can run while bucket ``i``'s finishes.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from rlhf_weightsync._collective import BroadcastTransport
from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.errors import WeightSyncError

__all__ = ["connect"]


def _local_address_towards(addr: str) -> str | None:
    """This host's IPv4 address on the route to ``addr`` (its own address when ``addr`` is local)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(addr), 9))  # picks a route; sends nothing
            return probe.getsockname()[0]
    except OSError:
        return None


def _device(master_addr: str):
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if iface:
        return dist.ProcessGroupGloo.create_device(interface=iface.split(",")[0])
    local = _local_address_towards(master_addr)
    if local is not None:
        return dist.ProcessGroupGloo.create_device(hostname=local)
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
