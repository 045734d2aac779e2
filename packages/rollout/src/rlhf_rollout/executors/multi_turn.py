"""Several turns against an environment; environment tokens are appended and masked out."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from rlhf_rollout._calls import named_call
from rlhf_rollout.engine import TokenGenerator
from rlhf_rollout.executors.base import (
    AgentExecutorBase,
    Trajectory,
    agenerate,
    check_labels,
    check_prompt_lengths,
    engine_max_model_len,
)
from rlhf_rollout.images import ImagePrompt
from rlhf_rollout.types import SamplingParams, VersionSpan

__all__ = ["AgentEnv", "MultiTurnExecutor", "StepResult", "chat_feedback_tokens"]


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """What an environment answers to one action."""

    feedback: str
    """Text shown to the model next (rendered to tokens by the executor); ignored when ``done``."""
    reward: float
    done: bool
    params: SamplingParams | None = None
    """Sampling parameters for the next turn, or ``None`` to keep the current ones."""
    extra_logs: dict[str, float] = field(default_factory=dict)
    images: tuple[Any, ...] = ()
    """Images shown with the feedback (a vision-language model), one per ``<image>`` in its text."""


class AgentEnv(Protocol):
    """A user's environment. One instance per episode."""

    async def reset(self, *, prompt: str, label: Any) -> None: ...

    async def step(self, *, action: str) -> StepResult: ...


def chat_feedback_tokens(tokenizer: Any) -> Callable[[str, bool], list[int]]:
    """Render feedback as a ``user`` chat turn followed by the assistant generation prompt.

    When the model's turn did not end with EOS (it was cut), the EOS token is prepended so the
    template stays well formed."""

    def render(text: str, ended_with_eos: bool) -> list[int]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        sep = tokenizer.encode("\n", add_special_tokens=False)
        prefix = sep if ended_with_eos else [tokenizer.eos_token_id, *sep]
        return prefix + list(ids)

    return render


class MultiTurnExecutor(AgentExecutorBase):
    """Drive one ``env_factory()`` per sample for up to ``max_turns`` turns.

    Each episode advances on its own: one asyncio task per sample runs reset, then its own loop of
    generate (one engine call per turn: that episode's context, ``n=1``) -> ``env.step`` -> append the
    feedback, with its own turn counter. An episode that ends early never waits for slower ones;
    episodes share the engine concurrently (``EngineClient.agenerate`` on Ray); a local engine takes
    their calls one at a time, in the order they were asked for. The context of turn ``k`` is exactly
    the token ids so far: the prompt, the engine's sampled ids (action, mask 1, with their logprobs)
    and the rendered feedback (mask 0, logprob 0). Model tokens are decoded only to show the
    environment the text; they are never re-encoded. The reward is the sum of step rewards.
    ``truncated`` is set when ``max_turns`` or ``max_length`` (total tokens) ends an episode the
    environment did not end; a turn that stops at ``max_new_tokens`` does not end the episode.
    With a fixed ``seed`` (the executor's, or one a ``StepResult.params`` sets), turn ``t`` of sample
    ``j`` of prompt ``i`` samples with ``seed + (i * n + j) * max_turns + t``, whatever the scheduling.
    ``extra_logs`` holds the environment's last values, ``turns`` and ``max_turn_tokens`` (the most
    tokens the policy generated in one turn: what a per-turn length penalty compares to
    ``max_new_tokens``). Output is prompt-major: sample ``j`` of prompt ``i`` at ``i * n + j``.
    An environment's ``reset`` / ``step`` that raises, returns a reward that is not a finite number, or
    (with ``step_timeout_s``) takes longer fails the batch naming the prompt, sample and turn; the
    other episodes are cancelled.
    """

    def __init__(
        self,
        *,
        engine: TokenGenerator,
        params: SamplingParams,
        tokenizer: Any,
        env_factory: Callable[[], AgentEnv],
        max_turns: int = 4,
        max_length: int | None = None,
        render_feedback: Callable[[str, bool], list[int]] | None = None,
        step_timeout_s: float | None = None,
        render_images: Callable[[str, Sequence[Any], bool], ImagePrompt] | None = None,
    ) -> None:
        super().__init__(engine=engine, params=replace(params, n=1))
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if step_timeout_s is not None and not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 (or None: no limit), got {step_timeout_s}")
        self.step_timeout_s = step_timeout_s
        self.samples_per_prompt = params.n
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.max_turns = max_turns
        self.max_length = max_length
        self.render_feedback = render_feedback or chat_feedback_tokens(tokenizer)
        self.render_images = render_images
        """Feedback with images as an :class:`ImagePrompt` (text, images, whether the turn ended with EOS)."""

    async def arun(
        self, prompts: Sequence[Sequence[int]], *, labels: Sequence[Any] | None = None
    ) -> list[Trajectory]:
        labels = check_labels(labels, len(prompts))
        engine_limit = engine_max_model_len(self.engine)
        limit = min(self.max_length or engine_limit, engine_limit)
        what = "the engine's max_model_len" if limit == engine_limit else "the executor's max_length"
        check_prompt_lengths(prompts, limit, what=what)
        eps = [
            _Episode(
                i=i, j=j, env=self.env_factory(), tokens=list(p), params=self.params, pictures=_Pictures.of(p)
            )
            for i, p in enumerate(prompts)
            for j in range(self.samples_per_prompt)
        ]
        texts = [self.tokenizer.decode(list(p), skip_special_tokens=True) for p in prompts]
        # Local engines run one call at a time anyway: queue their calls here, first come first
        # served, rather than as threads waiting on the engine's lock.
        queue = None if hasattr(self.engine, "agenerate") else asyncio.Lock()
        tasks = [asyncio.ensure_future(self._episode(e, texts[e.i], labels[e.i], limit, queue)) for e in eps]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [e.trajectory(len(prompts[e.i])) for e in eps]

    async def _episode(
        self, e: _Episode, text: str, label: Any, limit: int, queue: asyncio.Lock | None
    ) -> None:
        """One episode from reset to its end: generate -> step -> feedback, turn after turn."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        await self._env_call(e, "reset", 0, prompt=text, label=label)
        for turn in range(self.max_turns):
            await self._generate(e, turn, limit, queue)
            action = self.tokenizer.decode(e.last_action, skip_special_tokens=True)
            res = await self._env_call(e, "step", turn + 1, action=action)
            self._apply(e, res, eos, limit, last_turn=turn == self.max_turns - 1)
            if e.finished:
                return

    async def _env_call(self, e: _Episode, method: str, turn: int, **kwargs: Any) -> Any:
        """``e.env.<method>(**kwargs)``, bounded by ``step_timeout_s``; failures name the episode."""
        where = f"prompt {e.i} (sample {e.j}), turn {turn}"
        result = await named_call(
            getattr(e.env, method)(**kwargs),
            timeout_s=self.step_timeout_s,
            timed_out=f"environment {method} took over {self.step_timeout_s} s on {where}",
            failed=f"environment {method} failed on {where}:",
        )
        if method == "step":
            if not (hasattr(result, "reward") and hasattr(result, "done")):
                raise ValueError(
                    f"environment step on {where}: returned {type(result).__name__}, not a StepResult"
                )
            try:
                reward = float(result.reward)
            except (TypeError, ValueError):
                reward = math.nan
            if not math.isfinite(reward):
                raise ValueError(
                    f"environment step on {where}: reward must be a finite number, got {result.reward!r:.60}"
                )
        return result

    async def _generate(self, e: _Episode, turn: int, limit: int, queue: asyncio.Lock | None) -> None:
        """Turn ``turn`` of one episode: one engine call on its context, one sample."""
        p = e.params
        if p.seed is not None:  # a function of (seed, prompt, sample, turn) alone, not of timing
            p = replace(p, seed=p.seed + (e.i * self.samples_per_prompt + e.j) * self.max_turns + turn)
        room = limit - len(e.tokens)
        p = replace(p, n=1, max_new_tokens=max(1, min(p.max_new_tokens, room)))
        context = e.pictures.prompt(e.tokens)
        if queue is None:
            gens = await agenerate(self.engine, [context], p)
        else:
            async with queue:
                gens = await agenerate(self.engine, [context], p)
        g = gens[0][0]
        e.versions += [
            VersionSpan(v.version, v.start + len(e.tokens), v.end + len(e.tokens)) for v in g.weight_versions
        ]
        e.tokens += g.token_ids
        e.pictures.text(len(g.token_ids))
        e.mask += [True] * len(g.token_ids)
        e.logprobs += g.logprobs
        e.last_action = list(g.token_ids)
        e.turn_tokens.append(len(g.token_ids))
        e.turns += 1

    def _apply(self, e: _Episode, res: StepResult, eos: int | None, limit: int, *, last_turn: bool) -> None:
        e.reward += float(res.reward)
        for k, v in res.extra_logs.items():
            e.extra[k] = float(v)
        if res.done:
            e.finished = True
            return
        if last_turn:
            e.finished, e.truncated = True, True
            return
        ended = bool(e.last_action) and e.last_action[-1] == eos
        feedback = self._feedback(e, res, ended)
        if len(e.tokens) + len(feedback) >= limit or e.pictures.ambiguous(e.tokens, feedback):
            e.finished, e.truncated = True, True
            return
        e.pictures.add(feedback)
        e.tokens += feedback
        e.mask += [False] * len(feedback)
        e.logprobs += [0.0] * len(feedback)
        if res.params is not None:
            e.params = replace(res.params, n=1)

    def _feedback(self, e: _Episode, res: StepResult, ended_with_eos: bool) -> list[int]:
        """The feedback's tokens (an :class:`ImagePrompt` when it shows images)."""
        images = tuple(getattr(res, "images", ()) or ())
        if not images:
            return self.render_feedback(res.feedback, ended_with_eos)
        if self.render_images is None:
            raise ValueError(
                f"environment step on prompt {e.i} (sample {e.j}), turn {e.turns}: returned images, but "
                "the model takes none (a text-only model)"
            )
        return self.render_images(res.feedback, images, ended_with_eos)


@dataclass(kw_only=True)
class _Pictures:
    """The images of an episode's context so far, and which of its tokens are theirs."""

    images: list[Any] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    image_token_id: int | None = None

    @classmethod
    def of(cls, prompt: Sequence[int]) -> _Pictures:
        if isinstance(prompt, ImagePrompt):
            return cls(
                images=list(prompt.images),
                counts=list(prompt.image_token_counts),
                mask=prompt.image_mask(),
                image_token_id=prompt.image_token_id,
            )
        return cls(mask=[False] * len(prompt))

    def text(self, n: int) -> None:
        self.mask += [False] * n

    def add(self, tokens: list[int]) -> None:
        if not isinstance(tokens, ImagePrompt):
            return self.text(len(tokens))
        self.images += tokens.images
        self.counts += tokens.image_token_counts
        self.mask += tokens.image_mask()
        self.image_token_id = tokens.image_token_id
        return None

    def ambiguous(self, tokens: list[int], feedback: list[int]) -> bool:
        """Whether the policy sampled an image placeholder token into a context that holds images (or is
        about to): an engine that places images by their placeholder tokens would take it for one, so the
        episode ends there instead."""
        pad = feedback.image_token_id if isinstance(feedback, ImagePrompt) else self.image_token_id
        return pad is not None and any(t == pad and not m for t, m in zip(tokens, self.mask, strict=True))

    def prompt(self, tokens: list[int]) -> list[int]:
        """The context as the engine takes it: the ids, with the images when there are some."""
        if not self.images or self.image_token_id is None:
            return tokens
        return ImagePrompt(
            tokens,
            images=self.images,
            image_token_id=self.image_token_id,
            image_token_counts=self.counts,
            image_mask=self.mask,
        )


@dataclass(kw_only=True)
class _Episode:
    i: int
    j: int
    env: Any
    tokens: list[int]
    params: SamplingParams
    pictures: _Pictures = field(default_factory=_Pictures)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    finished: bool = False
    truncated: bool = False
    last_action: list[int] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)
    """Tokens the policy generated in each turn so far."""
    extra: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    versions: list[VersionSpan] = field(default_factory=list)
    """Weight-version spans of the policy's tokens, over the whole sequence."""

    def trajectory(self, prompt_len: int) -> Trajectory:
        return Trajectory(
            token_ids=self.tokens,
            action_mask=[False] * prompt_len + self.mask,
            logprobs=[0.0] * prompt_len + self.logprobs,
            prompt_len=prompt_len,
            reward=self.reward,
            score=self.reward,
            truncated=self.truncated,
            prompt_index=self.i,
            sample_index=self.j,
            weight_versions=tuple(self.versions),
            images=tuple(self.pictures.images),
            extra_logs={
                **self.extra,
                "turns": float(self.turns),
                "max_turn_tokens": float(max(self.turn_tokens, default=0)),
            },
        )
