"""The rollout pipeline's schedule (``rlhf_cli.ppo.pipeline``): a producer slowed by random delays and a
trainer with random update times, driven for many steps. Staleness stays within eta, the producer stays
within eta + 1 batches of the trainer, no sync lands inside a batch (unless partial rollout, and then only
between a pause and a resume), and nothing deadlocks. No engines: the timing is what is under test."""

from __future__ import annotations

import random
import threading
import time

import pytest
from rlhf_cli.data.prompts import PromptCursor
from rlhf_cli.ppo.pipeline import RolloutPipeline, staleness_metrics
from rlhf_cli.ppo.rollout import RolloutBatch
from rlhf_cli.runtime.learners.weight_sync import SyncReport


class Engines:
    """Weight versions, generation and pauses, with the events in order (one lock: several threads)."""

    def __init__(self, seed: int) -> None:
        self.version = 1
        self.rng = random.Random(seed)
        self.lock = threading.RLock()  # WeightPush's: held while weights move
        self._logging = threading.Lock()
        self.events: list[tuple] = []
        self.generating = 0
        self.paused = False
        self.trained = 0  # steps the trainer finished

    def log(self, *event) -> None:
        with self._logging:
            self.events.append(event)

    # WeightPush
    def push(self, *, version: int) -> SyncReport:
        assert version == self.version + 1
        self.log("push", version, self.generating, self.paused)
        time.sleep(self.rng.uniform(0, 0.004))
        self.version = version
        return SyncReport(version=version, seconds=0.0, num_bytes=0)

    # Pausable
    def pause(self, *, mode: str = "keep") -> None:
        assert mode == "keep"
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def wait_for(self, event: tuple, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(e[: len(event)] == event for e in self.events):  # ("start", 2): any version
            assert time.monotonic() < deadline, f"never happened: {event}"
            time.sleep(0.001)

    def produce(self, step: int, version: int) -> RolloutBatch:
        self.generating += 1
        self.log("start", step, version, self.trained)
        spans = []
        for token in range(3):  # three 'tokens', each sampled by the version the engines hold then
            if not self.paused:
                spans.append(self.version)
            time.sleep(self.rng.uniform(0, 0.003))
            if token == 0:
                self.after_first_token(step)
        self.generating -= 1
        self.log("done", step)
        return RolloutBatch(
            step=step,
            samples=[_Sampled(min(spans, default=version))],
            weight_version=version,
            cursor=PromptCursor(index=step),
            generation_s=0.0,
            reward_s=0.0,
        )

    def after_first_token(self, step: int) -> None:
        pass


class MidBatchSyncs(Engines):
    """Each batch after the first holds after its first token until the next version arrives (a sync
    that lands mid-batch), or 5 s."""

    def after_first_token(self, step: int) -> None:
        if step > 1:
            self.wait_for(("push", step), timeout=5.0)


class _Sampled:
    def __init__(self, version: int) -> None:
        self.weight_version = version
        self.mixed_versions = False


def drive(
    eta: int,
    *,
    partial: bool = False,
    steps: int = 30,
    seed: int = 0,
    threaded=None,
    before_sync=None,
    engines=None,
):
    """``before_sync(step)``: the event the trainer waits for before step ``step``'s sync."""
    eng = engines or Engines(seed)
    pipe = RolloutPipeline(
        eng.produce,
        eng,
        steps=range(1, steps + 1),
        max_staleness=eta,
        partial_rollout=partial,
        engines=eng,
        threaded=threaded,
    )
    lags = []
    try:
        for step in range(1, steps + 1):
            batch = pipe.take(step)
            assert batch.step == step
            policy = pipe.policy_version(step)
            assert policy == eng.version  # the trainer updates the version the engines hold
            lags.append(staleness_metrics(batch, policy_version=policy, eta=eta))
            time.sleep(eng.rng.uniform(0, 0.004))  # the update
            if before_sync is not None:
                eng.wait_for(before_sync(step))
            pipe.sync()
            eng.trained += 1
    finally:
        pipe.close()
    return eng, pipe, lags


@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_staleness_stays_within_eta_and_the_producer_within_eta_plus_one(eta, seed):
    eng, pipe, lags = drive(eta, seed=seed)
    assert all(m["sync/staleness_max"] <= eta for m in lags)
    starts = [e for e in eng.events if e[0] == "start"]
    assert [e[1] for e in starts] == list(range(1, 31))
    for _, step, version, trained in starts:
        assert step - trained <= eta + 1  # batches ahead of the trainer, this one included
        assert pipe.policy_version(step) - version <= eta
    assert max(pipe.produced_ahead) <= eta + 1
    pushes = [e for e in eng.events if e[0] == "push"]
    assert all(generating == 0 for _, _, generating, _ in pushes)  # never inside a batch


@pytest.mark.parametrize("eta", [1, 2])
def test_a_producer_faster_than_the_trainer_uses_all_of_eta(eta):
    """Batch s + eta is generated while step s trains, so from step eta + 1 on every sample is exactly
    eta versions old: eta is used, not just allowed (and never exceeded)."""
    # the update outlasts generation: the producer fills what eta admits before each sync
    _, pipe, lags = drive(eta, steps=12, before_sync=lambda s: ("done", min(s + eta, 12)))
    assert [m["sync/staleness_max"] for m in lags] == [min(s - 1, eta) for s in range(1, 13)]
    assert max(pipe.produced_ahead) == eta  # taken at step s: batches s .. s + eta - 1 were waiting


def test_at_eta_zero_the_producer_thread_follows_the_synchronous_order():
    inline, _, _ = drive(0, steps=8)
    threaded, _, _ = drive(0, steps=8, threaded=True)
    order = [(e[0], e[1]) for e in inline.events]
    assert order == [(e[0], e[1]) for e in threaded.events]
    expected = [x for s in range(1, 9) for x in (("start", s), ("done", s), ("push", s + 1))]
    assert order == expected
    starts = [e for e in threaded.events if e[0] == "start"]
    assert all(version == step for _, step, version, _ in starts)  # every batch on the current weights


def test_partial_rollout_syncs_only_into_paused_engines_and_counts_the_oldest_token():
    eng = MidBatchSyncs(3)
    # each sync waits until the next batch has started (it holds for the sync after one token)
    eng, _, lags = drive(
        1, partial=True, steps=12, engines=eng, before_sync=lambda s: ("start", min(s + 1, 12))
    )
    pushes = [e for e in eng.events if e[0] == "push"]
    assert all(paused for *_, paused in pushes)
    assert all(generating for _, _, generating, _ in pushes[:-1])  # mid-batch (the point of it)
    # batch s began on version s - 1 and ended on s: it counts from its oldest token
    assert [m["sync/staleness_max"] for m in lags] == [0] + [1] * 11


def test_a_failing_batch_is_raised_to_the_trainer():
    class Failing(Engines):
        def produce(self, step, version):
            if step == 3:
                raise ValueError("reward function failed on step 3")
            return super().produce(step, version)

    eng = Failing(0)
    pipe = RolloutPipeline(eng.produce, eng, steps=range(1, 6), max_staleness=1)
    try:
        pipe.take(1)
        pipe.sync()
        pipe.take(2)
        pipe.sync()
        with pytest.raises(ValueError, match="step 3"):
            pipe.take(3)
    finally:
        pipe.close()


def test_a_batch_is_scored_while_the_next_generates_and_taken_once_scored():
    eng = Engines(0)
    scored: list[int] = []
    running: list[int] = []  # scoring calls under way: one at a time (a group's collectives must not mix)

    def score(batch: RolloutBatch) -> None:
        running.append(batch.step)
        assert running == [batch.step], f"batches {running} scored at once"
        if batch.step == 1:  # the engines do not wait for the scoring groups
            eng.wait_for(("start", 2), timeout=5.0)
        time.sleep(0.01)  # a next batch produced meanwhile waits for its turn
        running.remove(batch.step)
        if batch.step == 3:
            raise ValueError("reference forward failed on step 3")
        scored.append(batch.step)

    pipe = RolloutPipeline(eng.produce, eng, steps=range(1, 6), score=score, max_staleness=1)
    try:
        for step in (1, 2):
            assert pipe.take(step).step == step
            assert step in scored
            pipe.sync()
        with pytest.raises(ValueError, match="step 3"):
            pipe.take(3)
    finally:
        pipe.close()


def test_partial_rollout_needs_a_staleness_bound_and_pausable_engines():
    eng = Engines(0)
    with pytest.raises(ValueError, match="partial rollout"):
        RolloutPipeline(
            eng.produce, eng, steps=range(1, 3), max_staleness=0, partial_rollout=True, engines=eng
        )
