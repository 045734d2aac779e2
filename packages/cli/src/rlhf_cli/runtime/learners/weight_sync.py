"""Actor -> engines: one rlhf-weightsync group per run, one versioned sync after every update."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rlhf_cli.runtime.learners.group import LearnerGroup
from rlhf_cli.runtime.runs.failures import get_all

__all__ = ["EngineWeightSync", "SyncReport"]


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    version: int
    seconds: float
    num_bytes: int

    def metrics(self) -> dict[str, float]:
        return {"time/sync": self.seconds, "sync/weight_version": float(self.version)}


class EngineWeightSync:
    """The actor group's rank 0 sends; every engine worker receives and resets its prefix cache."""

    def __init__(self, actor: LearnerGroup, engines: Any, *, transport: str, timeout_s: float) -> None:
        import ray

        self.actor, self.engines, self.transport, self.timeout_s = actor, engines, transport, timeout_s
        addr, port = ray.get(actor.workers[0].node_address.remote(), timeout=timeout_s)
        world = 1 + len(engines.engines) * engines.tensor_parallel_size
        joining = engines.init_weight_sync(
            transport=transport, master_addr=addr, master_port=port, timeout_s=timeout_s
        )
        hosting = actor.start_weight_sync(
            transport=transport, master_addr=addr, master_port=port, world_size=world, timeout_s=timeout_s
        )
        get_all(joining + hosting, timeout_s=timeout_s)
        self.version = 0
        self.description = (
            f"weight sync: actor rank 0 on {addr} -> {world - 1} engine process(es) over {transport}"
        )
        """One line for the run's log: where the weights go from, to how many processes, and how."""

    def push(self, *, version: int) -> SyncReport:
        """Send the actor's current weights as ``version`` and wait until every engine loaded them."""
        t0 = time.perf_counter()
        receiving = self.engines.receive_weights(timeout_s=self.timeout_s)
        sending = self.actor.start_send_weights(version=version)
        sent = get_all(sending + receiving, timeout_s=self.timeout_s)[0]  # rank 0's SyncStats
        self.version = version
        return SyncReport(version=version, seconds=time.perf_counter() - t0, num_bytes=sent.num_bytes)

    def close(self) -> None:
        import ray

        ray.get([e.close_weight_sync.remote() for e in self.engines.engines], timeout=self.timeout_s)
        self.actor.close_weight_sync()
