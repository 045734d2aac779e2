"""``nccl``: buckets broadcast over a private NCCL process group (GPU buffers, any hosts).

Each rank packs / receives on its current CUDA device (or ``device``). The group is a dedicated
``ProcessGroupNCCL`` over the rendezvous store with the sync timeout; ``torch.distributed``'s default
group and any group of the engine are untouched. NCCL needs one GPU per rank: two ranks of one group
cannot share a device (use ``cuda_ipc`` for a colocated engine).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from rlhf_weightsync._collective import BroadcastTransport
from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.errors import WeightSyncError

__all__ = ["connect", "cuda_device"]


def cuda_device(device: torch.device | str | None, transport: str) -> torch.device:
    """``device`` as a CUDA device with an index (default: the current one); ValueError otherwise."""
    if not torch.cuda.is_available():
        raise ValueError(f"transport {transport!r} needs CUDA, and torch.cuda.is_available() is False")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device: transport {transport!r} needs a CUDA device, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def connect(rdv: Rendezvous, *, bucket_bytes: int, device: torch.device | None) -> BroadcastTransport:
    dev = cuda_device(device, "nccl")  # the caller's current device is left as it is
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=rdv.timeout_s)
    try:
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", rdv.store), rdv.rank, rdv.world_size, opts)
        # Connect now (a tiny broadcast), so that a missing peer fails here and not mid-sync.
        probe = torch.zeros(1, device=dev)
        bopts = dist.BroadcastOptions()
        bopts.rootRank, bopts.rootTensor, bopts.timeout = 0, 0, timedelta(seconds=rdv.timeout_s)
        pg.broadcast([probe], bopts).wait(timedelta(seconds=rdv.timeout_s))
    except Exception as exc:
        others = rdv.receivers if rdv.rank == 0 else [0]
        raise WeightSyncError(
            f"nccl: rank {rdv.rank} could not connect the group on {dev}: {exc}; peers: {rdv.describe(others)}"
        ) from exc
    return BroadcastTransport(name="nccl", pg=pg, rdv=rdv, device=dev)
