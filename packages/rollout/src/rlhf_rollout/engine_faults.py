"""Engines that die while a run goes on: how a death is recognised, who replaces the engine, and what the
replacements cost."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["EngineFaults", "EngineReplacer", "engine_death"]


class EngineReplacer(Protocol):
    """Replaces a dead engine actor of an :class:`~rlhf_rollout.EngineClient`.

    ``start(index, error)`` starts a new actor in the dead one's place (its bundle, its cores) and returns
    it once started; ``load_weights(engines)`` then brings ``engines`` (the client's, the new one at
    ``index``) to the trainer's current weights (a weight-sync group is formed again around them), before
    the client hands the new engine any call. Either may raise: the client raises that error.

    ``lock`` is held for the whole replacement: the lock that the trainer holds while it moves weights
    (re-entrant), so that a replacement and a weight push never wait for each other in turn."""

    lock: AbstractContextManager[Any]

    def start(self, index: int, error: BaseException) -> Any: ...

    def load_weights(self, engines: Sequence[Any]) -> None: ...


@dataclass
class EngineFaults:
    """What engine deaths have cost a client so far."""

    restarts: int = 0
    """Replacements tried (a failed one counts)."""
    seconds_lost: float = 0.0
    """Per replacement: from the lost call's start until the new engine held the current weights."""

    def metrics(self) -> dict[str, float]:
        """``fault/*`` once an engine has been replaced (nothing before: the log of a run without faults
        keeps its columns)."""
        if not self.restarts:
            return {}
        return {"fault/engine_restarts": float(self.restarts), "fault/engine_seconds_lost": self.seconds_lost}


def engine_death(err: BaseException) -> bool:
    """``err`` is a Ray actor's death (its process killed or crashed), not an actor that is only
    unreachable for now (its node may be on its way out: the run as a whole handles that), nor an actor
    whose constructor raised (that error is the one to show), nor an error raised by a call."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    if isinstance(err, ActorUnavailableError) or not isinstance(err, RayActorError):
        return False
    return not getattr(err, "actor_init_failed", False)
