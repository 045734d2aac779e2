"""Train an agent written against the OpenAI API: run it against an :class:`OpenAIServer`, then
rebuild trajectories from the tokens the server recorded."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rlhf_rollout._calls import UserCodeError, user_frames
from rlhf_rollout.executors.base import Trajectory, check_labels

__all__ = ["OpenAIAgentExecutor", "trajectories_from_records"]

Agent = Callable[..., Awaitable[float]]
"""``await agent(base_url=..., api_key=..., prompt=..., label=...)`` → the episode's reward (``api_key``:
the server's bearer token, to pass to the OpenAI client)."""


def trajectories_from_records(
    records: Sequence[Any], *, reward: float, prompt_index: int = 0, sample_index: int = 0
) -> list[Trajectory]:
    """Chain a session's calls into trajectories, without re-tokenizing anything.

    A call whose prompt ids start with the previous trajectory's full token ids extends it: the new
    prompt tail (e.g. a tool result or the next user turn) is appended with mask 0, then the sampled
    tokens with mask 1. Any other call starts a new trajectory (the agent changed earlier tokens,
    e.g. by re-rendering its history from text). Only choice 0 of each call is chained. Every
    trajectory of the session gets ``reward``.
    """
    out: list[Trajectory] = []
    for rec in records:
        g = rec.generations[0]
        prev = out[-1] if out else None
        if prev is not None and rec.prompt_ids[: len(prev.token_ids)] == prev.token_ids:
            tail = rec.prompt_ids[len(prev.token_ids) :]
            prev.token_ids += tail + list(g.token_ids)
            prev.action_mask += [False] * len(tail) + [True] * len(g.token_ids)
            prev.logprobs += [0.0] * len(tail) + list(g.logprobs)
            prev.truncated = g.finish_reason == "length"
            continue
        out.append(
            Trajectory.from_generation(
                rec.prompt_ids,
                g,
                reward=reward,
                score=reward,
                prompt_index=prompt_index,
                sample_index=sample_index,
            )
        )
    return out


class OpenAIAgentExecutor:
    """Run ``agent`` once per (prompt, sample), each in its own server session, concurrently.

    ``prompts`` here are texts (the agent decides how to talk to the model). Returns, prompt-major,
    the trajectories of every session (one or more each; see :func:`trajectories_from_records`).
    """

    def __init__(self, *, server: Any, agent: Agent, samples_per_prompt: int = 1) -> None:
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
        self.server = server
        self.agent = agent
        self.samples_per_prompt = samples_per_prompt

    async def arun(self, prompts: Sequence[str], *, labels: Sequence[Any] | None = None) -> list[Trajectory]:
        labels = check_labels(labels, len(prompts))
        jobs = [
            (i, j, f"s{uuid.uuid4().hex}")
            for i in range(len(prompts))
            for j in range(self.samples_per_prompt)
        ]

        async def one(i: int, j: int, session: str) -> list[Trajectory]:
            try:
                reward = float(
                    await self.agent(
                        base_url=self.server.base_url(session),
                        api_key=self.server.api_key or "none",
                        prompt=prompts[i],
                        label=labels[i],
                    )
                )
            except Exception as err:  # their frames (their file and line), not ours
                self.server.pop_records(session)
                message = f"agent failed on prompt {i} (sample {j}): {err!r}"
                raise UserCodeError(message, user_traceback=user_frames(err)) from err
            records = self.server.pop_records(session)
            if not records:
                raise ValueError(f"agent made no model call on prompt {i} (sample {j})")
            return trajectories_from_records(records, reward=reward, prompt_index=i, sample_index=j)

        parts = await asyncio.gather(*(one(*job) for job in jobs))
        return [t for part in parts for t in part]

    def run(self, prompts: Sequence[str], *, labels: Sequence[Any] | None = None) -> list[Trajectory]:
        return asyncio.run(self.arun(prompts, labels=labels))
