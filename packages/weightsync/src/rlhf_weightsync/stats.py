"""What one sync moved and how long it took."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SyncStats"]


@dataclass(frozen=True, kw_only=True)
class SyncStats:
    """Summary of one sync, as seen by the side that returns it."""

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
