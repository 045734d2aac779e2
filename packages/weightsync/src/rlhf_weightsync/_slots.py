"""Shared machinery of the memory-sharing transports (``shm``, ``cuda_ipc``): slots plus flag handshakes.

The sender owns a ring of ``len(slots)`` buffers (at least two) that every receiver has mapped;
bucket ``i`` lives in slot ``i % len(slots)``. Handshakes are int64 sequence numbers in a small
shared-memory file, one 64-byte line each: ``ready[slot]`` (written by the sender) and
``consumed[rank]`` (written by receiver ``rank``). Bucket ``i`` of sync ``n`` has sequence number
``n * 2**32 + i + 1``, so numbers only grow.

- sender: pack bucket ``i`` into its slot, ``ready[slot] = seq(i)``; before packing bucket
  ``i + len(slots)`` into the same slot, wait until every ``consumed[r] >= seq(i)``.
- receiver: wait until ``ready[slot] >= seq(i)``, read the slot in place, ``consumed[rank] = seq(i)``.

Packing one bucket overlaps loading another; with ``len(slots)`` slots the two sides run up to
``len(slots) - 1`` buckets apart without waiting for each other (``shm`` uses a ring of four,
``cuda_ipc`` two). Waits poll the flags (back-off from 10 us to 0.2 ms, so a hand-off costs little
more than a wake-up; 20 ms once a wait exceeds a second), check every 0.2 s whether an awaited peer's process has exited, and give up after the sync timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync._shmfile import share_file
from rlhf_weightsync.errors import WeightSyncError
from rlhf_weightsync.protocol import Tamper

__all__ = ["SlotTransport"]

_LINE = 8  # int64 words per 64-byte line: each flag on its own cache line
_LIVENESS_S = 0.2
_barrier_lock = threading.Lock()


def _barrier() -> None:
    """A full memory barrier for this thread (a mutex acquire and release), ordering data and flags."""
    with _barrier_lock:
        pass


class SlotTransport:
    """Buckets handed over in place through ``slots`` (flat uint8 buffers, one per slot)."""

    def __init__(
        self,
        *,
        name: str,
        rdv: Rendezvous,
        slots: list[torch.Tensor],
        device: torch.device,
        fence: Callable[[], None] = lambda: None,
    ) -> None:
        self.name, self.device = name, device
        self.tamper: Tamper | None = None
        if len(slots) < 2:
            raise ValueError(f"slots: a {name} transport needs at least two, got {len(slots)}")
        self._rdv, self._slots, self._fence = rdv, slots, fence
        self._n = len(slots)
        self._flags = share_file(rdv, f"{name}_flags", 64 * (self._n + rdv.world_size)).view(torch.int64)
        self._sync, self._sizes = -1, []
        self._posted = -1  # sender: last bucket posted in this sync

    def _seq(self, index: int) -> int:
        return (self._sync << 32) + index + 1

    def _ready(self, slot: int) -> int:
        return int(self._flags[slot * _LINE])

    def _consumed(self, rank: int) -> int:
        return int(self._flags[(self._n + rank) * _LINE])

    def begin(self, sync: int, sizes: Sequence[int]) -> None:
        capacity = self._slots[0].numel() if self._slots else 0
        too_big = [i for i, n in enumerate(sizes) if n > capacity]
        if too_big:
            raise WeightSyncError(
                f"{self.name}: bucket {too_big[0]} needs {sizes[too_big[0]]} bytes, but the slots hold {capacity}"
            )
        self._sync, self._sizes, self._posted = sync, list(sizes), -1

    def _poll(self, missing: Callable[[], list[int]], *, what: str) -> None:
        if not missing():
            _barrier()
            return
        timeout = self._rdv.timeout_s
        t0 = time.monotonic()
        next_check, delay = t0 + _LIVENESS_S, 1e-5
        while True:
            time.sleep(delay)
            late = missing()
            if not late:
                _barrier()
                return
            now = time.monotonic()
            delay = min(2 * delay, 2e-4 if now - t0 < 1.0 else 2e-2)
            if now >= next_check or now - t0 >= timeout:
                self._rdv.raise_if_gone(
                    late, what=what, waited=now - t0, timeout=timeout, final=now - t0 >= timeout
                )
                next_check = now + _LIVENESS_S

    def _await_consumed(self, index: int) -> None:
        seq = self._seq(index)
        self._poll(
            lambda: [r for r in self._rdv.receivers if self._consumed(r) < seq],
            what=f"{self.name}: receivers to consume bucket {index + 1}/{len(self._sizes)} of sync {self._sync}",
        )

    # sender
    def acquire(self, index: int) -> torch.Tensor:
        if index >= self._n:
            self._await_consumed(index - self._n)
        return self._slots[index % self._n][: self._sizes[index]]

    def post(self, index: int) -> None:
        self._fence()  # device writes must have landed before anyone is told
        _barrier()
        self._flags[(index % self._n) * _LINE] = self._seq(index)
        self._posted = index

    def flush(self) -> None:
        if self._posted >= 0:  # receivers consume in order: the last bucket implies all
            self._await_consumed(self._posted)

    # receiver
    def wait(self, index: int) -> torch.Tensor:
        seq, slot = self._seq(index), index % self._n
        self._poll(
            lambda: [0] if self._ready(slot) < seq else [],
            what=f"{self.name}: the sender's bucket {index + 1}/{len(self._sizes)} of sync {self._sync}",
        )
        buf = self._slots[slot][: self._sizes[index]]
        if self.tamper is not None:
            self.tamper(index, buf)
        return buf

    def release(self, index: int) -> None:
        self._fence()  # reads of the slot must be finished before the sender may overwrite it
        _barrier()
        self._flags[(self._n + self._rdv.rank) * _LINE] = self._seq(index)

    def close(self) -> None:
        self._slots = []
