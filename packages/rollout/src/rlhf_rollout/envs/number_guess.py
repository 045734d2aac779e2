"""Guess a secret integer; the environment answers "higher", "lower" or "correct"."""

from __future__ import annotations

import re
from typing import Any

from rlhf_rollout.executors.multi_turn import StepResult

__all__ = ["NumberGuessEnv"]

_INT = re.compile(r"-?\d+")


class NumberGuessEnv:
    """The label is the secret number. Each action's first integer is the guess.

    Feedback: ``"Higher."`` / ``"Lower."`` (reward 0), ``"Correct!"`` (reward 1, done), or
    ``"Answer with a whole number."`` (reward ``invalid_reward``) when the action holds no integer.
    """

    def __init__(self, *, invalid_reward: float = -0.1) -> None:
        self.invalid_reward = invalid_reward
        self.secret: int | None = None
        self.guesses: list[int] = []

    async def reset(self, *, prompt: str, label: Any) -> None:
        try:
            self.secret = int(label)
        except (TypeError, ValueError) as err:
            raise ValueError(f"NumberGuessEnv: label must be an integer, got {label!r}") from err
        self.guesses = []

    async def step(self, *, action: str) -> StepResult:
        if self.secret is None:
            raise RuntimeError("NumberGuessEnv.step called before reset")
        match = _INT.search(action)
        if match is None:
            return StepResult(feedback="Answer with a whole number.", reward=self.invalid_reward, done=False)
        guess = int(match.group())
        self.guesses.append(guess)
        logs = {"guesses": float(len(self.guesses))}
        if guess == self.secret:
            return StepResult(feedback="Correct!", reward=1.0, done=True, extra_logs=logs)
        hint = "Higher." if guess < self.secret else "Lower."
        return StepResult(feedback=hint, reward=0.0, done=False, extra_logs=logs)
