"""Choosing the transport for a placement: what ``auto`` means, and which choices cannot work."""

from __future__ import annotations

from typing import Literal, cast

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
    backend: Literal["vllm", "transformers"],
    gpus_per_worker: float,
) -> TransportName:
    """The transport to use for ``requested`` (``auto`` or a transport name) on this placement.

    ``auto``: with GPUs and the ``vllm`` backend, ``nccl`` when every process has a whole GPU
    (``gpus_per_worker == 1``), else ``cuda_ipc`` (processes share a GPU); otherwise ``shm`` on one
    host and ``gloo`` across hosts. Raises a one-line ``ValueError`` naming ``--weightsync.transport``
    for an unknown name, ``nccl`` / ``cuda_ipc`` without GPUs, ``shm`` across hosts, and the
    ``transformers`` backend with anything but ``gloo`` or ``shm``.
    """
    if backend not in ("vllm", "transformers"):
        raise ValueError(f"{FLAG}: unknown rollout backend {backend!r}; expected 'vllm' or 'transformers'")
    if requested == "auto":
        if gpu and backend == "vllm":  # NCCL needs one GPU per rank; shared GPUs use CUDA IPC
            return "nccl" if gpus_per_worker == 1 else "cuda_ipc"
        return "shm" if one_host else "gloo"
    if requested not in TRANSPORTS:
        raise ValueError(f"{FLAG} {requested}: unknown; expected auto or one of {', '.join(TRANSPORTS)}")
    transport = cast(TransportName, requested)
    if transport in GPU_TRANSPORTS and not gpu:
        raise ValueError(f"{FLAG} {transport}: needs GPUs; the cluster has none")
    if transport == "shm" and not one_host:
        raise ValueError(f"{FLAG} shm: needs every process on one host; the cluster spans several")
    if backend == "transformers" and transport not in CPU_TRANSPORTS:
        raise ValueError(
            f"{FLAG} {transport}: --rollout.backend transformers receives weights over gloo or shm only"
        )
    return transport
