"""Engines that die while a run goes on: how a death is recognised, who replaces the engine, and what the
replacements cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["EngineFaults", "EngineReplacer", "engine_death"]


class EngineReplacer(Protocol):
    """Replaces a dead engine actor of an :class:`~rlhf_rollout.EngineClient`.

    ``start(index, error)`` starts a new actor in the dead one's place (its bundle, its cores) and returns
    it once started; the client then puts it at ``index`` and calls ``load_weights()``, which brings every
    engine of the client to the trainer's current weights (a weight-sync group is rebuilt around the new
    member). Either may raise: the run then stops with that error."""

    def start(self, index: int, error: BaseException) -> Any: ...

    def load_weights(self) -> None: ...


@dataclass
class EngineFaults:
    """What engine deaths have cost a client so far."""

    restarts: int = 0
    seconds_lost: float = 0.0
    """Per replacement: from the lost call's start until the new engine held the current weights."""

    def metrics(self) -> dict[str, float]:
        """``fault/*`` once an engine has been replaced (nothing before: the log of a run without faults
        keeps its columns)."""
        if not self.restarts:
            return {}
        return {"fault/engine_restarts": float(self.restarts), "fault/engine_seconds_lost": self.seconds_lost}


def engine_death(err: BaseException) -> bool:
    """``err`` is a Ray actor's death or loss (its process killed, crashed, its node gone), not an actor
    whose constructor raised (that error is the one to show) nor an error raised by a call."""
    from ray.exceptions import RayActorError

    return isinstance(err, RayActorError) and not getattr(err, "actor_init_failed", False)
