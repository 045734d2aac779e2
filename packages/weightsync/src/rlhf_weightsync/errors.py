"""Errors raised by a sync. All derive from :class:`WeightSyncError`."""

from __future__ import annotations

__all__ = ["ChecksumError", "PeerTimeoutError", "WeightSyncError"]


class WeightSyncError(RuntimeError):
    """A sync failed: a peer reported an error, a transport failed, or the group is unusable."""


class ChecksumError(WeightSyncError):
    """Received bytes do not match the sender's checksum; the message names the bucket and tensor."""


class PeerTimeoutError(WeightSyncError, TimeoutError):
    """A peer did not answer within the timeout, or its process (on this host) exited while awaited;
    the message names the peer(s), their pids and hosts, and what was awaited."""
