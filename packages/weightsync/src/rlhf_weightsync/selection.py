"""Choosing the transport for a placement: what ``auto`` means, and which choices cannot work."""

from __future__ import annotations

from typing import cast

from rlhf_weightsync.protocol import TRANSPORTS, TransportName

__all__ = ["select_transport"]

FLAG = "--weightsync.transport"
GPU_TRANSPORTS: tuple[TransportName, ...] = ("nccl", "cuda_ipc")
CPU_TRANSPORTS: tuple[TransportName, ...] = ("gloo", "shm")


def select_transport(
    requested: str,
    *,
    gpu: bool,
    one_host: bool,
    gpu_receivers: bool,
    gpus_per_worker: float,
) -> TransportName:
    """The transport to use for ``requested`` (``auto`` or a transport name) on this placement.

    ``gpu_receivers``: the engines can receive weights on their GPUs (vLLM's workers); False: into host
    memory only (the transformers engine). ``auto``: with GPUs and GPU receivers, ``nccl`` when every
    process has a whole GPU (``gpus_per_worker == 1``), else ``cuda_ipc`` (processes share a GPU);
    otherwise ``shm`` on one host and ``gloo`` across hosts. Raises a one-line ``ValueError`` naming
    ``--weightsync.transport`` for an unknown name, ``nccl`` / ``cuda_ipc`` without GPUs or to engines
    that receive in host memory, and ``shm`` across hosts.
    """
    if requested == "auto":
        if gpu and gpu_receivers:  # NCCL needs one GPU per rank; shared GPUs use CUDA IPC
            return "nccl" if gpus_per_worker == 1 else "cuda_ipc"
        return "shm" if one_host else "gloo"
    if requested not in TRANSPORTS:
        raise ValueError(f"{FLAG} {requested}: unknown; expected auto or one of {', '.join(TRANSPORTS)}")
    transport = cast(TransportName, requested)
    if transport in GPU_TRANSPORTS and not gpu:
        raise ValueError(f"{FLAG} {transport}: needs GPUs; the cluster has none")
    if transport == "shm" and not one_host:
        raise ValueError(f"{FLAG} shm: needs every process on one host; the cluster spans several")
    if not gpu_receivers and transport not in CPU_TRANSPORTS:
        raise ValueError(f"{FLAG} {transport}: these engines receive weights in host memory: use gloo or shm")
    return transport
