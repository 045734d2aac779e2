"""What one sync moved and how long it took: :class:`SyncStats`, and the plain-dict
:class:`WeightSyncReport` that worker extensions return across process boundaries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

__all__ = ["SyncStats", "WeightSyncReport"]


class WeightSyncReport(TypedDict):
    """:class:`SyncStats` as a plain dict: what ``receive_weights`` returns. A dict of builtins crosses
    every hop unchanged (vLLM's msgpack ``collective_rpc`` would turn a dataclass into a dict anyway);
    rlhf-rollout declares the same keys (``rlhf_rollout.WeightSyncReport``)."""

    version: int
    num_tensors: int
    num_names: int
    num_buckets: int
    num_bytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class SyncStats:
    """Summary of one sync, as seen by the side that returns it. A plain frozen dataclass of builtins:
    it pickles (and so crosses Ray) as itself."""

    version: int
    """Weights version of this sync (the sender's counter, or the ``version=`` it was given)."""
    num_tensors: int
    """Distinct tensors shipped (tied names share one tensor and count once)."""
    num_names: int
    """Names delivered, tied aliases included."""
    num_buckets: int
    num_bytes: int
    """Tensor bytes shipped, in the wire dtype (padding and checksum trailers excluded)."""
    seconds: float
    """Wall time of the sync on this side, from start to the last acknowledgement."""

    @property
    def gb_per_s(self) -> float:
        """Throughput in GB/s (10**9 bytes per second) of tensor bytes."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def to_report(self) -> WeightSyncReport:
        """These stats as a :class:`WeightSyncReport` (a new dict)."""
        return WeightSyncReport(
            version=self.version,
            num_tensors=self.num_tensors,
            num_names=self.num_names,
            num_buckets=self.num_buckets,
            num_bytes=self.num_bytes,
            seconds=self.seconds,
        )

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> SyncStats:
        """Stats from a :class:`WeightSyncReport` (extra keys are refused, missing ones too)."""
        return cls(**report)
