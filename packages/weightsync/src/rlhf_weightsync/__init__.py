"""rlhf-weightsync: bucketed, checksummed learner-to-engine weight transfer.

A :class:`WeightSender` (rank 0, in the trainer) and :class:`WeightReceiver` s (ranks 1.., in the
engines) form a private group from an address, port, rank and world size; ``sender.send(...)``
ships one set of weights in fixed-size buckets over ``gloo``, ``shm``, ``nccl`` or ``cuda_ipc``, and
``receiver.receive(load_fn)`` verifies and hands ``(name, tensor)`` pairs to ``load_fn``. vLLM engines
receive through :mod:`rlhf_weightsync.vllm_ext`; :func:`select_transport` picks the transport for a
placement.
"""

from rlhf_weightsync.errors import ChecksumError, PeerTimeoutError, WeightSyncError
from rlhf_weightsync.layout import Manifest, TensorSpec, plan_buckets
from rlhf_weightsync.loaders import copy_into
from rlhf_weightsync.protocol import TRANSPORTS, Transport, TransportName
from rlhf_weightsync.receiver import LoadFn, WeightReceiver
from rlhf_weightsync.selection import select_transport
from rlhf_weightsync.sender import DEFAULT_BUCKET_BYTES, GatherFn, WeightSender, gather_along
from rlhf_weightsync.stats import SyncStats, WeightSyncReport

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "TRANSPORTS",
    "ChecksumError",
    "GatherFn",
    "LoadFn",
    "Manifest",
    "PeerTimeoutError",
    "SyncStats",
    "TensorSpec",
    "Transport",
    "TransportName",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "WeightSyncReport",
    "copy_into",
    "gather_along",
    "plan_buckets",
    "select_transport",
]
