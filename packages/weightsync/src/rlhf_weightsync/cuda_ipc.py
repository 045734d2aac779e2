"""``cuda_ipc``: buckets handed over in GPU memory shared through CUDA IPC handles (colocated GPU).

For an engine that shares the learner's GPU: the sender allocates ``num_slots`` bucket buffers on its
device once and publishes their IPC handles (``torch.multiprocessing.reductions.reduce_tensor``)
through the rendezvous store; each receiver opens them once, on its local index of the same physical
GPU (matched by UUID, so differing ``CUDA_VISIBLE_DEVICES`` are fine). Per bucket only handshakes
travel (flags in host shared memory, see ``_slots.py``): no bytes are copied between processes, and
receivers load straight from the sender's buffer. Stream fences make the handshakes safe: the sender synchronizes its stream before
``ready``, a receiver before ``consumed``.
"""

from __future__ import annotations

import pickle

import torch

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync._slots import SlotTransport
from rlhf_weightsync.errors import WeightSyncError
from rlhf_weightsync.nccl import cuda_device

__all__ = ["NUM_SLOTS", "connect"]

NUM_SLOTS = 2
"""GPU bucket buffers (each ``bucket_bytes``): one being packed while the other is loaded."""

_DEVICE_ARG = 6  # position of the device index in rebuild_cuda_tensor's arguments


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def connect(rdv: Rendezvous, *, bucket_bytes: int, device: torch.device | None) -> SlotTransport:
    from torch.multiprocessing.reductions import reduce_tensor

    dev = cuda_device(device, "cuda_ipc")  # the caller's current device is left as it is
    if rdv.rank == 0:
        flat = torch.zeros(NUM_SLOTS * bucket_bytes, dtype=torch.uint8, device=dev)
        slots = list(flat.view(NUM_SLOTS, bucket_bytes).unbind(0))
        handles = [reduce_tensor(s) for s in slots]
        rdv.set("cuda_ipc/handles", pickle.dumps({"uuid": _uuid(dev.index), "handles": handles}))
        rdv.wait_ranks("cuda_ipc/opened", rdv.receivers, what="receivers to open the CUDA IPC buffers")
    else:
        rdv.wait([("cuda_ipc/handles", 0)], what="the sender's CUDA IPC handles")
        doc = pickle.loads(rdv.get("cuda_ipc/handles"))
        local = [i for i in range(torch.cuda.device_count()) if _uuid(i) == doc["uuid"]]
        if not local:
            raise WeightSyncError(
                f"cuda_ipc: rank {rdv.rank} cannot see the sender's GPU {doc['uuid']} (use 'nccl' across GPUs)"
            )
        dev = torch.device("cuda", local[0])
        slots = []
        for rebuild, args in doc["handles"]:
            args = list(args)
            args[_DEVICE_ARG] = local[0]
            slots.append(rebuild(*args))
        rdv.set(f"cuda_ipc/opened/{rdv.rank}")
    stream_dev = dev

    def fence() -> None:
        torch.cuda.current_stream(stream_dev).synchronize()

    return SlotTransport(name="cuda_ipc", rdv=rdv, slots=slots, device=dev, fence=fence)
