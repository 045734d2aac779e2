"""The trajectory an executor hands to training, and the executor base class."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf_rollout.engine import TokenGenerator
from rlhf_rollout.images import prompt_images
from rlhf_rollout.types import Generation, SamplingParams, VersionSpan

__all__ = ["AgentExecutorBase", "Trajectory", "agenerate"]


@dataclass(kw_only=True)
class Trajectory:
    """One sample, token in / token out.

    ``token_ids = prompt + (response | environment feedback)*``. ``action_mask[t]`` is true exactly
    for tokens the policy sampled (the tokens training acts on); ``logprobs[t]`` is the rollout
    engine's logprob of token ``t`` under the sampling distribution (NaN when the sampling params asked
    for none), ``0.0`` where the mask is false.
    The three lists have equal length; the model's tokens are the engine's ids, never re-tokenized.
    """

    token_ids: list[int]
    action_mask: list[bool]
    logprobs: list[float]
    prompt_len: int
    """Number of leading prompt tokens (all masked out)."""
    reward: float
    """Scalar reward of the whole trajectory (sum of step rewards for multi-turn)."""
    score: float
    """The reward source's ``scores`` entry (e.g. 0/1 correctness used by dynamic filtering);
    equals ``reward`` when the source gives none."""
    truncated: bool
    """True when the trajectory hit a length limit (or the turn limit) instead of ending itself."""
    prompt_index: int = 0
    sample_index: int = 0
    extra_logs: dict[str, float] = field(default_factory=dict)
    weight_versions: tuple[VersionSpan, ...] = ()
    """Which weight versions sampled the policy's tokens, as spans over ``token_ids`` (several when a
    weight update landed mid-generation; empty when the engine labels no versions)."""
    images: tuple[Any, ...] = ()
    """The images whose tokens ``token_ids`` holds, in order (an :class:`~rlhf_rollout.ImagePrompt`'s)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.action_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                f"trajectory lengths differ: {n} tokens, {len(self.action_mask)} mask entries, "
                f"{len(self.logprobs)} logprobs"
            )

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @classmethod
    def from_generation(
        cls, prompt_ids: Sequence[int], generation: Generation, *, reward: float, score: float, **fields: Any
    ) -> Trajectory:
        """``prompt + one generation``: the generation's tokens are the actions, with its logprobs;
        truncated when it stopped at the length limit."""
        p, out = list(prompt_ids), list(generation.token_ids)
        return cls(
            token_ids=p + out,
            action_mask=[False] * len(p) + [True] * len(out),
            logprobs=[0.0] * len(p) + list(generation.logprobs),
            prompt_len=len(p),
            reward=reward,
            score=score,
            truncated=generation.finish_reason == "length",
            weight_versions=tuple(
                VersionSpan(v.version, v.start + len(p), v.end + len(p)) for v in generation.weight_versions
            ),
            images=prompt_images(prompt_ids),
            **fields,
        )


async def agenerate(
    engine: TokenGenerator, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> list[list[Generation]]:
    """Await ``engine.agenerate`` when it exists (Ray client); otherwise run the blocking
    ``engine.generate`` in a thread, one call at a time per engine (local engines are not re-entrant)."""
    if hasattr(engine, "agenerate"):
        return await engine.agenerate(prompts, params)
    lock = _engine_lock(engine)

    def call():
        with lock:
            return engine.generate(prompts, params)

    return await asyncio.to_thread(call)


_LOCKS: dict[int, threading.Lock] = {}
"""One lock per local engine object, shared by every executor using it; an entry is removed when its
engine is garbage-collected (engines that cannot be weakly referenced keep theirs)."""
_LOCKS_GUARD = threading.Lock()


def _engine_lock(engine: TokenGenerator) -> threading.Lock:
    key = id(engine)
    with _LOCKS_GUARD:
        lock = _LOCKS.get(key)
        if lock is None:
            lock = _LOCKS[key] = threading.Lock()
            with contextlib.suppress(TypeError):  # TypeError: not weak-referenceable
                weakref.finalize(engine, _LOCKS.pop, key, None)
        return lock


class AgentExecutorBase(ABC):
    """Turns prompts into :class:`Trajectory` s using an engine (a :class:`TokenGenerator`)."""

    def __init__(self, *, engine: TokenGenerator, params: SamplingParams) -> None:
        self.engine = engine
        self.params = params

    @abstractmethod
    async def arun(
        self, prompts: Sequence[Sequence[int]], *, labels: Sequence[Any] | None = None
    ) -> list[Trajectory]:
        """Trajectories ordered prompt-major: sample ``j`` of prompt ``i`` at ``i * n + j``."""

    def run(
        self, prompts: Sequence[Sequence[int]], *, labels: Sequence[Any] | None = None
    ) -> list[Trajectory]:
        """Blocking :meth:`arun` (not from inside a running event loop)."""
        return asyncio.run(self.arun(prompts, labels=labels))


def engine_max_model_len(engine: TokenGenerator) -> int:
    """``engine.max_model_len`` (a property of local engines and of ``EngineClient``)."""
    return int(engine.max_model_len)


def check_prompt_lengths(
    prompts: Sequence[Sequence[int]], limit: int, *, what: str = "the engine's max_model_len"
) -> None:
    """Name the first prompt (by its index in the whole batch) that leaves no room to generate."""
    for i, p in enumerate(prompts):
        if len(p) >= limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; {what} is {limit}, which leaves no room to generate"
            )


def check_labels(labels: Sequence[Any] | None, num_prompts: int) -> list[Any]:
    if labels is None:
        return [None] * num_prompts
    if len(labels) != num_prompts:
        raise ValueError(f"labels has {len(labels)} entries for {num_prompts} prompts")
    return list(labels)
