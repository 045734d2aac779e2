"""Rollouts ahead of training, with the staleness bounded when a batch is admitted (AReaL's rule).

The trainer asks for step ``s``'s batch (:meth:`RolloutPipeline.take`) and, after its update, syncs the
new weights (:meth:`RolloutPipeline.sync`). With ``max_staleness`` eta = 0 the batch is produced when
asked, so generation, training and sync alternate exactly as in synchronous training. With eta >= 1 a
producer thread generates ahead: step ``s``'s batch is started only once the engines hold version
``P(s) - eta``, where ``P(s)`` is the version the trainer will update at step ``s`` (one more per step).
So a trained sample lags the policy by at most eta versions and the producer is never more than eta + 1
batches ahead; nothing generated is dropped (which would favour short answers). Each sync happens
between batches, under a lock the producer holds while generating, so no sample mixes versions, unless
``partial_rollout``: then the engines pause at a token boundary, load the weights and resume, and a
sample's staleness counts from its oldest token. A generated batch is scored (the reference forward) on a
second thread while the producer starts the next one, so the engines do not wait for the scoring groups.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from rlhf_cli.ppo.rollout import RolloutBatch
from rlhf_cli.runtime.learners.weight_sync import SyncReport

__all__ = ["Pausable", "RolloutPipeline", "WeightPush", "staleness_metrics"]


class WeightPush(Protocol):
    """The trainer's weight sync (``EngineWeightSync``): the engines' version, and a push of the next."""

    version: int
    lock: contextlib.AbstractContextManager
    """Held while weights move: a push into paused engines holds it around the pause too (an engine's
    replacement, which pushes to the engines as they are, waits for it)."""

    def push(self, *, version: int) -> SyncReport: ...


class Pausable(Protocol):
    """Engines that stop at a token boundary and go on (``EngineClient`` over asynchronous engines)."""

    def pause(self, *, mode: str = "keep") -> None: ...

    def resume(self) -> None: ...


class Phases(Protocol):
    """The hybrid engine's memory schedule (``runtime.memory_phases.MemoryPhases``)."""

    def after_rollout(self) -> None: ...

    def around_push(self, push: Callable[[], SyncReport]) -> SyncReport: ...

    def notes(self) -> list[str]: ...


class _NoPhases:
    def notes(self) -> list[str]:
        return []

    def after_rollout(self) -> None:
        pass

    def around_push(self, push: Callable[[], SyncReport]) -> SyncReport:
        return push()


T = TypeVar("T")

Produce = Callable[[int, int], RolloutBatch]
"""``produce(step, weight_version) -> RolloutBatch`` (``RolloutStage.produce``)."""


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class RolloutPipeline:
    """Hands the trainer one :class:`RolloutBatch` per step; see the module docstring for the rule.

    ``produce`` generates (holding the engines); ``score`` then finishes a batch without them (e.g. the
    reference forward; with the producer thread, on a thread of its own, in order, while the next batch
    generates). ``steps``: the steps to produce, in order. ``threaded``: run the producer thread
    even at eta = 0 (the same schedule as producing inline; tests compare the two). The trainer waits for
    the producer as long as it runs: each engine, reward and learner call inside has its own time limit.
    ``phases``: colocated engines and learners (synchronous only): the engines release their memory after
    each rollout and take it back around each push (``MemoryPhases``).
    """

    def __init__(
        self,
        produce: Produce,
        weights: WeightPush,
        *,
        steps: range,
        score: Callable[[RolloutBatch], None] | None = None,
        max_staleness: int = 0,
        partial_rollout: bool = False,
        engines: Pausable | None = None,
        threaded: bool | None = None,
        phases: Phases | None = None,
    ) -> None:
        threaded = threaded if threaded is not None else max_staleness > 0
        if partial_rollout and (max_staleness < 1 or engines is None):
            raise ValueError("partial rollout needs max_staleness >= 1 and engines that pause")
        if phases is not None and threaded:
            raise ValueError("colocated engines and learners take turns: no rollouts ahead of training")
        self.phases: Phases = phases if phases is not None else _NoPhases()
        self.produce, self.score, self.weights, self.steps = produce, score, weights, steps
        self.max_staleness, self.partial, self.engines = max_staleness, partial_rollout, engines
        self.first_version = weights.version
        self._changed = threading.Condition()  # the version moved, a sync is wanted or done, or stop
        self._generating = threading.Lock()  # held while a batch generates (no sync then, unless partial)
        self._sync_wanted = False  # the trainer waits to sync: the producer starts no batch meanwhile
        self._ready: queue.Queue[Future[RolloutBatch] | _Failed] = queue.Queue()
        # One scoring thread: batches are scored in order, and a multi-rank group's collectives never
        # interleave two batches' forwards.
        self._to_score: queue.SimpleQueue[tuple[RolloutBatch, Future[RolloutBatch]] | None] = (
            queue.SimpleQueue()
        )
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.produced_ahead: list[int] = []
        """For each batch taken: batches produced but not yet taken at that moment (including it)."""
        if threaded:
            self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
            self._thread.start()
            threading.Thread(target=self._score_all, name="rollout-scorer", daemon=True).start()

    def policy_version(self, step: int) -> int:
        """The version the trainer updates at ``step`` (the engines' version when its batch is taken in
        synchronous training)."""
        return self.first_version + (step - self.steps.start)

    def admits(self, step: int, engine_version: int) -> bool:
        """Step ``step``'s batch may start on engines holding ``engine_version``."""
        return engine_version >= self.policy_version(step) - self.max_staleness

    def take(self, step: int) -> RolloutBatch:
        """Step ``step``'s batch (they are taken in order)."""
        if self._thread is None:
            self.produced_ahead.append(1)
            batch = self.produce(step, self.weights.version)
            self.phases.after_rollout()  # colocated: the engines release the devices to the learners
            if self.score is not None:
                self.score(batch)
            return batch
        got = self._wait(lambda: self._ready.get(timeout=1.0), f"step {step}'s rollout batch")
        if isinstance(got, _Failed):
            raise got.error
        got = got.result()  # scored (each scoring call has its own time limit); raises what scoring raised
        if got.step != step:
            raise RuntimeError(f"the producer made step {got.step}'s batch where step {step}'s was due")
        self.produced_ahead.append(self._ready.qsize() + 1)
        return got

    def _wait(self, attempt: Callable[[], T], what: str) -> T:
        """``attempt()`` (which gives up after a second) until it succeeds, as long as the producer runs
        (each of its engine, reward and learner calls has its own time limit); once it has stopped, what
        it left in the queue is taken, else this raises."""
        while True:
            try:
                return attempt()
            except (queue.Empty, TimeoutError):
                if (self._thread is not None and self._thread.is_alive()) or not self._ready.empty():
                    continue
                raise RuntimeError(f"the rollout producer stopped before {what}") from None

    def _lock_engines(self) -> None:
        def attempt() -> None:
            if not self._generating.acquire(timeout=1.0):
                raise TimeoutError

        with self._changed:
            self._sync_wanted = True
        try:
            self._wait(attempt, "the engines (a batch is generating)")
        finally:
            with self._changed:
                self._sync_wanted = False
                self._changed.notify_all()

    def sync(self) -> SyncReport:
        """Push the trainer's weights as the next version: between batches (the producer's batch in flight
        finishes first; it starts no other meanwhile), or, with partial rollout, into paused engines."""
        version = self.weights.version + 1
        if self.partial:
            assert self.engines is not None
            with self.weights.lock:
                try:
                    self.engines.pause(mode="keep")
                    report = self.weights.push(version=version)
                finally:
                    self.engines.resume()
        else:
            self._lock_engines()
            try:
                report = self.phases.around_push(lambda: self.weights.push(version=version))
            finally:
                self._generating.release()
        with self._changed:
            self._changed.notify_all()
        return report

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engines to the trainer alone (evaluation): no batch generates meanwhile."""
        self._lock_engines()
        try:
            yield
        finally:
            self._generating.release()

    def close(self) -> None:
        """Stop the producer and the scorer: they start no other batch; one generating or scoring is left
        to the engines' and groups' shutdown (the threads are daemons), so a failed run does not wait."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._to_score.put(None)
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _admitted(self, step: int) -> bool:
        """Wait until ``step`` may start (False: the pipeline stops)."""
        with self._changed:
            while not self._stopping and (self._sync_wanted or not self.admits(step, self.weights.version)):
                self._changed.wait(timeout=1.0)
            return not self._stopping

    def _run(self) -> None:
        try:
            for step in self.steps:
                if not self._admitted(step):
                    return
                with self._generating:  # partial rollout syncs without it; evaluation waits for it
                    batch = self.produce(step, self.weights.version)
                scored: Future[RolloutBatch] = Future()
                self._ready.put(scored)
                self._to_score.put((batch, scored))
        except BaseException as err:  # handed to the trainer, which raises it
            self._ready.put(_Failed(err))

    def _score_all(self) -> None:
        """The scorer thread: each produced batch in turn, its result (or error) into its future."""
        while (item := self._to_score.get()) is not None and not self._stopping:
            batch, scored = item
            try:
                if self.score is not None:
                    self.score(batch)
            except BaseException as err:  # handed to the trainer, which raises it
                scored.set_exception(err)
            else:
                scored.set_result(batch)


def staleness_metrics(batch: RolloutBatch, *, policy_version: int, eta: int) -> dict[str, float]:
    """``sync/staleness_*``: how many versions the batch's samples lag the policy they train (mean, max and
    the share at each lag 0..eta); ``sync/mixed_version_frac``: the share of samples whose tokens more than
    one weight version sampled (partial rollout's updates landing mid-generation)."""
    lag = policy_version - torch.tensor([s.weight_version for s in batch.samples], dtype=torch.float64)
    out = {"sync/staleness_mean": float(lag.mean()), "sync/staleness_max": float(lag.max())}
    out["sync/mixed_version_frac"] = sum(s.mixed_versions for s in batch.samples) / len(batch.samples)
    for k in range(eta + 1):
        out[f"sync/staleness_{k}_frac"] = float((lag == k).double().mean())
    return out


def wait_metrics(seconds: float, ahead: int | None) -> dict[str, float]:
    """``time/wait_rollout`` (the trainer idle, waiting for a batch) and ``async/batches_ahead``."""
    out = {"time/wait_rollout": seconds}
    if ahead is not None:
        out["async/batches_ahead"] = float(ahead)
    return out


def timed_take(pipeline: RolloutPipeline, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """Step ``step``'s batch and the wait metrics of taking it."""
    t0 = time.perf_counter()
    batch = pipeline.take(step)
    ahead = pipeline.produced_ahead[-1] if pipeline.produced_ahead else None
    return batch, wait_metrics(time.perf_counter() - t0, ahead)
