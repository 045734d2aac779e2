"""The built-in task of ``rlhf ppo`` with no model given: answer with the larger of two digits.

Verifiable (reward 1 for the right digit, else 0), small enough for a tiny model trained from scratch on
two CPU cores: a short supervised warm-up teaches the answer format, reinforcement learning the rule.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from rlhf_cli.data import PromptRecord

__all__ = ["TASK_NAME", "answer", "build_demo_model", "records", "reward_func"]

TASK_NAME = "larger-digit"
_DIGIT = re.compile(r"\d")


def _prompt(a: int, b: int) -> str:
    return f"max {a} {b} ="


def answer(a: int, b: int) -> str:
    return str(max(a, b))


def records(*, split: str, seed: int) -> list[PromptRecord]:
    """Every ordered pair of distinct digits; ``eval`` holds a fixed quarter of them, ``train`` the rest
    (so the evaluation measures the rule, not memorised pairs)."""
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    random.Random(1234).shuffle(pairs)
    held = set(pairs[: len(pairs) // 4])
    chosen = [p for p in pairs if (p in held) == (split == "eval")]
    random.Random(seed).shuffle(chosen)
    return [PromptRecord(prompt=_prompt(a, b), label=answer(a, b)) for a, b in chosen]


def warmup_records(*, seed: int) -> list[tuple[str, str]]:
    """(prompt, response) pairs for the format warm-up: a digit from the prompt, right or not."""
    rng = random.Random(seed)
    out = []
    for r in records(split="train", seed=seed):
        a, b = (int(x) for x in str(r.prompt).split()[1:3])
        out.append((str(r.prompt), f" {rng.choice((a, b))}"))
    return out


def reward_func(queries: list[str], prompts: list[str], labels: list[Any], **_: Any) -> dict:
    """1 when the first digit of the response is the label, else 0."""
    rewards = []
    for q, p, label in zip(queries, prompts, labels, strict=True):
        m = _DIGIT.search(q[len(p) :])
        rewards.append(1.0 if m is not None and m.group() == str(label) else 0.0)
    return {"rewards": rewards, "scores": rewards}


def build_demo_model(directory: Path) -> Path:
    """The tiny model of the demo (built offline; the same folder is reused when it exists)."""
    from rlhf_testkit import TinyModelSpec, build_tiny_model

    if (directory / "config.json").is_file():
        return directory
    return build_tiny_model(
        directory, TinyModelSpec(num_hidden_layers=2, hidden_size=128, intermediate_size=256)
    )
