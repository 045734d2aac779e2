"""One generation per sample, then a reward from a function or remote servers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rlhf_rollout.engine import TokenGenerator
from rlhf_rollout.executors.base import (
    AgentExecutorBase,
    Trajectory,
    agenerate,
    check_labels,
    check_prompt_lengths,
    engine_max_model_len,
)
from rlhf_rollout.images import ImagePrompt, prompt_images
from rlhf_rollout.rewards import RewardResult, RewardSource
from rlhf_rollout.types import Generation, SamplingParams

__all__ = ["SingleTurnExecutor"]


class SingleTurnExecutor(AgentExecutorBase):
    """Prompt → ``params.n`` responses → rewards.

    The batch is cut into chunks of ``chunk_size`` prompts that run concurrently: while one chunk
    generates, finished chunks are decoded and scored, so scoring overlaps generation. The reward
    source sees decoded texts (``queries`` = prompt + response, ``prompts``) and the labels of each
    sample's prompt; with ``reward=None`` rewards are 0.
    """

    def __init__(
        self,
        *,
        engine: TokenGenerator,
        params: SamplingParams,
        tokenizer: Any,
        reward: RewardSource | None = None,
        chunk_size: int | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        super().__init__(engine=engine, params=params)
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.tokenizer = tokenizer
        self.reward = reward
        self.chunk_size = chunk_size
        self.skip_special_tokens = skip_special_tokens

    async def arun(
        self, prompts: Sequence[Sequence[int]], *, labels: Sequence[Any] | None = None
    ) -> list[Trajectory]:
        labels = check_labels(labels, len(prompts))
        check_prompt_lengths(prompts, engine_max_model_len(self.engine))
        size = self.chunk_size or max(1, len(prompts))
        starts = range(0, len(prompts), size)
        parts = await asyncio.gather(
            *(self._chunk(prompts, labels, lo, min(lo + size, len(prompts))) for lo in starts)
        )
        return [t for part in parts for t in part]

    async def _chunk(self, prompts, labels, lo: int, hi: int) -> list[Trajectory]:
        params = self.params
        chunk_params = params
        if params.seed is not None:  # same per-sample seeds whatever the chunking (vLLM)
            chunk_params = replace(params, seed=params.seed + lo * params.n)
        rows = [p if isinstance(p, ImagePrompt) else list(p) for p in prompts[lo:hi]]
        gens = await agenerate(self.engine, rows, chunk_params)
        flat: list[tuple[int, int, Generation]] = [
            (lo + i, j, g) for i, per_prompt in enumerate(gens) for j, g in enumerate(per_prompt)
        ]
        result = await self._score(prompts, labels, flat)
        out = []
        for k, (i, j, g) in enumerate(flat):
            out.append(
                Trajectory.from_generation(
                    prompts[i],
                    g,
                    reward=result.rewards[k],
                    score=result.scores[k],
                    prompt_index=i,
                    sample_index=j,
                    extra_logs={key: v[k] for key, v in result.extra_logs.items()},
                )
            )
        return out

    async def _score(self, prompts, labels, flat) -> RewardResult:
        if self.reward is None:
            zeros = [0.0] * len(flat)
            return RewardResult(rewards=zeros, scores=zeros)
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prompt_texts = {i: decode(list(prompts[i]), skip_special_tokens=skip) for i, _, _ in flat}
        queries = [prompt_texts[i] + decode(list(g.token_ids), skip_special_tokens=skip) for i, _, g in flat]
        images = [prompt_images(prompts[i]) for i, _, _ in flat]
        pictured = {"images": images} if any(images) else {}  # a text batch: the call as before images
        try:
            return await self.reward.ascore(
                queries=queries,
                prompts=[prompt_texts[i] for i, _, _ in flat],
                labels=[labels[i] for i, _, _ in flat],
                **pictured,
            )
        except ValueError as err:
            first = flat[0][0] if flat else 0
            raise ValueError(
                f"{err} (sample numbers count from prompt {first}, n={self.params.n} each)"
            ) from err
        except (RuntimeError, TimeoutError) as err:  # raised, hung, or a server failed: name the batch
            lo, hi = (flat[0][0], flat[-1][0]) if flat else (0, 0)
            raise _same_kind(err, f"{err} (batch of prompts {lo}..{hi}, n={self.params.n} each)") from err


def _same_kind(err: Exception, message: str) -> Exception:
    """An exception of ``err``'s type with ``message`` (a ``RuntimeError`` when the type needs more)."""
    try:
        return type(err)(message)
    except Exception:
        return RuntimeError(message)
