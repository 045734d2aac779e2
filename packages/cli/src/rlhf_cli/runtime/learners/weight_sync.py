"""Actor -> engines: one rlhf-weightsync group per run, one versioned sync after every update."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_cli.runtime.learners.group import LearnerGroup
from rlhf_cli.runtime.runs.failures import get_all

__all__ = ["EngineWeightSync", "SyncReport"]


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    version: int
    seconds: float
    num_bytes: int
    faults: dict[str, float] = field(default_factory=dict)
    """What replacing dead engines has cost the run so far (``fault/*``; empty while none died)."""

    def metrics(self) -> dict[str, float]:
        return {"time/sync": self.seconds, "sync/weight_version": float(self.version)} | self.faults


class EngineWeightSync:
    """The actor group's rank 0 sends; every engine worker receives and resets its prefix cache. ``lock``
    (re-entrant; given, or made here) is held while weights move; a caller that pauses the engines around
    a push holds it around both, and so does an engine's replacement."""

    def __init__(
        self,
        actor: LearnerGroup,
        engines: Any,
        *,
        transport: str,
        timeout_s: float,
        lock: contextlib.AbstractContextManager | None = None,
        with_frozen_tower: bool = False,
    ) -> None:
        self.actor, self.engines, self.transport, self.timeout_s = actor, engines, transport, timeout_s
        self.with_frozen_tower = with_frozen_tower
        """Send a frozen vision tower too: the engines drop their weights while asleep (sleep level 2)."""
        self.lock = lock if lock is not None else threading.RLock()
        self.version = 0
        self._join(engines.engines)

    def _join(self, engines: Sequence[Any]) -> None:
        """Form the sync group: rank 0 hosts it on a free port, every worker of ``engines`` joins."""
        import ray

        addr, port = ray.get(self.actor.workers[0].node_address.remote(), timeout=self.timeout_s)
        world = 1 + len(engines) * self.engines.tensor_parallel_size
        joining = self.engines.init_weight_sync(
            transport=self.transport,
            master_addr=addr,
            master_port=port,
            timeout_s=self.timeout_s,
            engines=engines,
        )
        hosting = self.actor.start_weight_sync(
            transport=self.transport,
            master_addr=addr,
            master_port=port,
            world_size=world,
            timeout_s=self.timeout_s,
        )
        get_all(joining + hosting, timeout_s=self.timeout_s)
        self.description = (
            f"weight sync: actor rank 0 on {addr} -> {world - 1} engine process(es) over {self.transport}"
        )
        """One line for the run's log: where the weights go from, to how many processes, and how."""

    def push(self, *, version: int) -> SyncReport:
        """Send the actor's current weights as ``version`` and wait until every engine loaded them."""
        with self.lock:
            t0 = time.perf_counter()
            sent = self._send(version, self.engines.engines)
            self.version = version
            seconds, faults = time.perf_counter() - t0, self.engines.faults.metrics()
            return SyncReport(version=version, seconds=seconds, num_bytes=sent.num_bytes, faults=faults)

    def _send(self, version: int, engines: Sequence[Any]) -> Any:
        receiving = self.engines.receive_weights(timeout_s=self.timeout_s, engines=engines)
        sending = self.actor.start_send_weights(version=version, with_frozen_tower=self.with_frozen_tower)
        return get_all(sending + receiving, timeout_s=self.timeout_s)[0]  # rank 0's SyncStats

    def rejoin(self, engines: Sequence[Any]) -> None:
        """After an engine was replaced: the group formed again around ``engines`` (the client's, the new
        one in), and the actor's current weights sent to all, labelled as the last version pushed (in an
        asynchronous run the actor may be one update further: its next push labels that one)."""
        with self.lock:
            self.close_quietly()
            self._join(engines)
            self._send(self.version, engines)

    def close(self) -> None:
        import ray

        ray.get([e.close_weight_sync.remote() for e in self.engines.engines], timeout=self.timeout_s)
        self.actor.close_weight_sync()

    def close_quietly(self) -> None:
        """Leave the group on every side that still answers (a dead engine cannot say goodbye), waiting
        at most ``timeout_s`` for all the engines together."""
        import ray

        refs = [e.close_weight_sync.remote() for e in self.engines.engines]
        ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s, fetch_local=False)
        with contextlib.suppress(Exception):
            self.actor.close_weight_sync()
