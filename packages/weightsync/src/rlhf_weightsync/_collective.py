"""Shared machinery of the broadcast transports (``gloo``, ``nccl``): double-buffered async broadcasts.

The sender packs bucket ``i + 1`` while bucket ``i`` is on the wire; each receiver has the broadcast
of bucket ``i + 1`` posted while its load callback consumes bucket ``i``. Collectives are issued in
the same order (bucket 0, 1, 2, ...) on every rank, as collectives must be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.errors import WeightSyncError
from rlhf_weightsync.protocol import Tamper

__all__ = ["BroadcastTransport"]


class BroadcastTransport:
    """Buckets broadcast from rank 0 over a private process group ``pg`` on ``device``."""

    def __init__(self, *, name: str, pg, rdv: Rendezvous, device: torch.device, num_buffers: int = 2) -> None:
        self.name, self.device = name, device
        self._pg, self._rdv, self._k = pg, rdv, num_buffers
        self._bufs: list[torch.Tensor] = []
        self._capacity = 0
        self._sync, self._sizes = -1, []
        self._works: dict[int, object] = {}
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank, self._opts.rootTensor = 0, 0
        self._opts.timeout = timedelta(seconds=rdv.timeout_s)
        self.tamper: Tamper | None = None

    def begin(self, sync: int, sizes: Sequence[int]) -> None:
        self._sync, self._sizes, self._works = sync, list(sizes), {}
        need = max(self._sizes, default=0)
        if need > self._capacity:
            self._bufs = []  # free the old ones first
            self._bufs = [torch.empty(need, dtype=torch.uint8, device=self.device) for _ in range(self._k)]
            self._capacity = need
        if self._rdv.rank != 0:
            for i in range(min(self._k, len(self._sizes))):
                self._start(i)

    def _view(self, index: int) -> torch.Tensor:
        return self._bufs[index % self._k][: self._sizes[index]]

    def _start(self, index: int) -> None:
        try:
            self._works[index] = self._pg.broadcast([self._view(index)], self._opts)
        except Exception as exc:
            raise self._error(index, exc) from exc

    def _finish(self, index: int) -> None:
        work = self._works.pop(index)
        try:
            work.wait(self._opts.timeout)  # blocks the CPU (also for NCCL) so that the timeout holds
        except Exception as exc:
            raise self._error(index, exc) from exc

    def _error(self, index: int, exc: Exception) -> WeightSyncError:
        peers = self._rdv.receivers if self._rdv.rank == 0 else [0]
        return WeightSyncError(
            f"{self.name}: rank {self._rdv.rank}: broadcast of bucket {index + 1}/{len(self._sizes)} "
            f"({self._sizes[index]} bytes) of sync {self._sync} failed: {exc}; peers: {self._rdv.describe(peers)}"
        )

    # sender
    def acquire(self, index: int) -> torch.Tensor:
        if index - self._k in self._works:
            self._finish(index - self._k)
        return self._view(index)

    def post(self, index: int) -> None:
        self._start(index)

    def flush(self) -> None:
        for index in sorted(self._works):
            self._finish(index)

    # receiver
    def wait(self, index: int) -> torch.Tensor:
        self._finish(index)
        buf = self._view(index)
        if self.tamper is not None:
            self.tamper(index, buf)
        return buf

    def release(self, index: int) -> None:
        if index + self._k < len(self._sizes):
            self._start(index + self._k)

    def close(self) -> None:
        self._works, self._bufs, self._capacity = {}, [], 0
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.shutdown()
