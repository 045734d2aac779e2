"""A multi-turn environment for `rlhf ppo --train.agent_func_path examples/multi_turn_env.py`.

The policy answers a question; a wrong answer gets a hint and another try, with less reward for each
try it needed. The file is an agent file: it defines `make_env()`, and `rlhf ppo` calls it once per
sampled episode. The contract (docs/agents.md):

- `async reset(*, prompt, label)`: a new episode; `prompt` is the prompt's text, `label` the data row's
  label (here: the expected answer).
- `async step(*, action) -> StepResult`: the policy's last turn as text; the result's `feedback` is shown
  to the policy as the next user turn, `reward` adds to the episode's reward, `done` ends it, and
  `extra_logs` become `extra/<name>` metrics.

Run it alone to play one episode with scripted answers: `python examples/multi_turn_env.py`.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from rlhf_rollout.executors import StepResult

MAX_TRIES = 3
_NUMBER = re.compile(r"-?\d+")


class RetryQuizEnv:
    """Reward 1 for a right first answer, 1/2 for a right second one, 1/3 for a third; 0 after
    ``MAX_TRIES`` wrong ones."""

    def __init__(self) -> None:
        self.answer: str | None = None
        self.tries = 0

    async def reset(self, *, prompt: str, label: Any) -> None:
        self.answer, self.tries = str(label).strip(), 0

    async def step(self, *, action: str) -> StepResult:
        self.tries += 1
        found = _NUMBER.search(action)
        logs = {"tries": float(self.tries)}
        if found is not None and found.group() == self.answer:
            return StepResult(feedback="", reward=1.0 / self.tries, done=True, extra_logs=logs)
        if self.tries >= MAX_TRIES:
            return StepResult(feedback="", reward=0.0, done=True, extra_logs=logs)
        hint = "That is not a number; answer with one." if found is None else "Not quite. Try again."
        return StepResult(feedback=hint, reward=0.0, done=False, extra_logs=logs)


def make_env() -> RetryQuizEnv:
    """Called by `rlhf ppo` once per episode."""
    return RetryQuizEnv()


async def _play(answers: list[str], label: str) -> float:
    env, total = make_env(), 0.0
    await env.reset(prompt="What is 3 + 4?", label=label)
    for answer in answers:
        result = await env.step(action=answer)
        total += result.reward
        print(f"policy: {answer!r:>14}  env: {result.feedback or '(done)'!r}  reward {result.reward:.2f}")
        if result.done:
            break
    return total


if __name__ == "__main__":
    total = asyncio.run(_play(["It is 8.", "seven", "7"], label="7"))
    print(f"episode reward: {total:.2f}")
