"""The hybrid engine's memory schedule: when rollout engines and learner groups share devices
(``--train.colocate_*``), one object decides the order of release, acquire, offload and reload.

Per step: the engines generate (awake) -> the engines sleep (``--vllm.sleep_level``: 1 keeps the weights
in host memory, 2 drops them) and the learners reload their states -> experience and updates -> the
engines wake their weights, the new weights are pushed into them (over CUDA IPC on a shared GPU), then
the learners offload (``--train.offload_during_rollout``) and the engines wake their KV cache -> the next
rollout. Every call is capability-gated: an engine without sleep mode (vLLM's CPU backend) or a learner
with nothing to move (on CPU) is reported as skipped, with the reason, never silently passed over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["MemoryPhases", "PhaseLog", "SleepingEngines"]


class SleepingEngines(Protocol):
    """What the schedule needs of the engines (``EngineClient``)."""

    def capabilities(self) -> list[Any]: ...

    def sleep(self, *, level: int = 1) -> None: ...

    def wake_up(self, *, tags: list[str] | None = None) -> None: ...


class Offloading(Protocol):
    """What it needs of a learner group (``LearnerGroup``)."""

    def offload_states(self) -> list[str]: ...

    def reload_states(self) -> list[str]: ...


@dataclass
class PhaseLog:
    """What each phase did, in order (``(action, outcome)``); the first skip of each kind is kept once."""

    events: list[tuple[str, str]] = field(default_factory=list)

    def add(self, action: str, outcome: str) -> None:
        if outcome.startswith("skipped") and (action, outcome) in self.events:
            return
        self.events.append((action, outcome))

    def notes(self) -> list[str]:
        return [f"{a}: {o}" for a, o in self.events if o.startswith("skipped")]


class MemoryPhases:
    """The schedule above. Not colocated (``enabled=False``): every phase does nothing and says so once.

    ``push``: the weight push (``RolloutPipeline.sync`` calls :meth:`around_push` with it)."""

    def __init__(
        self,
        engines: SleepingEngines,
        learners: Sequence[Offloading],
        *,
        enabled: bool,
        sleep_level: int = 1,
        offload: bool = False,
    ) -> None:
        self.engines, self.learners, self.enabled = engines, list(learners), enabled
        self.sleep_level, self.offload = sleep_level, offload
        self.log = PhaseLog()
        self.asleep = False
        self._can_sleep: bool | None = None

    def _sleep_capable(self) -> bool:
        if self._can_sleep is None:
            caps = self.engines.capabilities()
            self._can_sleep = all(c.sleep for c in caps)
            self._why = "; ".join(sorted({c.notes for c in caps if not c.sleep})) or "no sleep mode"
        return self._can_sleep

    def _engines(self, action: str, call: Callable[[], None]) -> None:
        if not self.enabled:
            self.log.add(action, "skipped: the engines are not colocated with the learners")
        elif not self._sleep_capable():
            self.log.add(action, f"skipped: {self._why}")
        else:
            call()
            self.log.add(action, "done")

    def _learners(self, action: str, reload: bool) -> None:
        if not (self.enabled and self.offload):
            self.log.add(action, "skipped: --train.offload_during_rollout is off or nothing is colocated")
            return
        for g in self.learners:
            for outcome in g.reload_states() if reload else g.offload_states():
                self.log.add(action, outcome)

    def notes(self) -> list[str]:
        """What the schedule could not do here, and why (once each; shown under the run's summary)."""
        return self.log.notes()

    def after_rollout(self) -> None:
        """The engines release their memory; the learners take theirs back."""
        self._engines(f"engines sleep (level {self.sleep_level})", self._sleep)
        self._learners("learners reload", reload=True)

    def around_push(self, push: Callable[[], Any]) -> Any:
        """Wake the engines' weights, push, then offload the learners and wake the KV cache."""
        if self.asleep or not self.enabled:
            self._engines("engines wake weights", lambda: self.engines.wake_up(tags=["weights"]))
        out = push()
        self.before_rollout()
        return out

    def before_rollout(self) -> None:
        """The learners offload and the engines' KV cache comes back (after the start-up push, too)."""
        self._learners("learners offload", reload=False)
        if self.asleep or not self.enabled:
            self._engines("engines wake KV cache", self._wake_cache)

    def _sleep(self) -> None:
        self.engines.sleep(level=self.sleep_level)
        self.asleep = True

    def _wake_cache(self) -> None:
        self.engines.wake_up(tags=["kv_cache"])
        self.asleep = False
