"""The hybrid engine's memory schedule against recording fakes: no generation while the engines sleep,
their weights wake before the push and their KV cache after it, the learners reload before the update
and offload after the push; on engines without sleep mode every step is reported as skipped."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from rlhf_cli.data.prompts import PromptCursor
from rlhf_cli.ppo.pipeline import RolloutPipeline
from rlhf_cli.ppo.rollout import RolloutBatch
from rlhf_cli.runtime.learners.memory_phases import MemoryPhases
from rlhf_cli.runtime.learners.weight_sync import SyncReport


@dataclass
class Caps:
    sleep: bool
    notes: str = ""


class Recorder:
    """Engines, one learner group and the weight sync, writing what happens to one list."""

    def __init__(self, *, can_sleep: bool = True) -> None:
        self.events: list[str] = []
        self.weights_awake = self.cache_awake = True
        self.can_sleep, self.version = can_sleep, 1

    # engines
    def capabilities(self):
        return [Caps(self.can_sleep, "" if self.can_sleep else "vLLM's CPU backend has no sleep mode")]

    def sleep(self, *, level: int = 1) -> None:
        self.events.append(f"sleep{level}")
        self.weights_awake = self.cache_awake = False

    def wake_up(self, *, tags=None) -> None:
        self.events.append(f"wake {','.join(tags)}")
        if "weights" in tags:
            self.weights_awake = True
        if "kv_cache" in tags:
            self.cache_awake = True

    # learners
    def offload_states(self):
        self.events.append("offload")
        return ["offloaded"]

    def reload_states(self):
        self.events.append("reload")
        return ["reloaded"]

    # weights and generation
    def push(self, *, version: int) -> SyncReport:
        assert self.weights_awake, "the weights wake before the push"
        assert not (self.can_sleep and self.cache_awake), "the KV cache wakes after the push"
        self.events.append("push")
        self.version = version
        return SyncReport(version=version, seconds=0.0, num_bytes=0)

    def produce(self, step: int, version: int) -> RolloutBatch:
        assert self.weights_awake and self.cache_awake, "no generation while asleep"
        self.events.append("generate")
        return RolloutBatch(
            step=step, samples=[], weight_version=version, cursor=PromptCursor(), generation_s=0, reward_s=0
        )


def run_steps(rec: Recorder, phases: MemoryPhases, steps: int = 2) -> None:
    phases.before_rollout()  # after the start-up push
    pipe = RolloutPipeline(rec.produce, rec, steps=range(1, steps + 1), phases=phases)
    for step in range(1, steps + 1):
        pipe.take(step)
        rec.events.append("train")
        pipe.sync()


@pytest.mark.parametrize("level", [1, 2])
def test_colocated_steps_follow_the_schedule(level):
    rec = Recorder()
    phases = MemoryPhases(rec, [rec], enabled=True, sleep_level=level, offload=True)
    run_steps(rec, phases)
    step = [
        "generate",
        f"sleep{level}",
        "reload",
        "train",
        "wake weights",
        "push",
        "offload",
        "wake kv_cache",
    ]
    assert rec.events == ["offload", *step, *step]
    assert not phases.log.notes()


def test_engines_without_sleep_mode_are_reported_never_silently_skipped():
    rec = Recorder(can_sleep=False)
    phases = MemoryPhases(rec, [rec], enabled=True, offload=False)
    run_steps(rec, phases)
    assert rec.events == ["generate", "train", "push", "generate", "train", "push"]
    notes = phases.log.notes()
    assert "engines sleep (level 1): skipped: vLLM's CPU backend has no sleep mode" in notes
    assert any(n.startswith("learners reload: skipped") for n in notes)
    assert len(notes) == len(set(notes))  # each reason once, not once per step
