"""The built-in vision-language task (``rlhf ppo --train.demo_model vlm``): a coloured shape on a plain
background, asked its colour or its shape; the answer is one word.

The images are drawn offline (seeded), small enough for the tiny Qwen2-VL (56x56 pixels: 4 image tokens).
A short supervised warm-up teaches the answer format (a word of the asked kind, right or not); reinforcement
learning has to look at the image to pick the right one.
"""

from __future__ import annotations

import random
from typing import Any

from rlhf_cli.data.prompts import PromptRecord

__all__ = [
    "COLOURS",
    "QUESTIONS",
    "SHAPES",
    "TASK_NAME",
    "draw",
    "records",
    "reward_func",
    "warmup_records",
]

TASK_NAME = "shape-colour"
COLOURS = {"red": (215, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 215), "yellow": (225, 205, 30)}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = {"colour": "<image>colour?", "shape": "<image>shape?"}
"""The two questions; ``<image>`` is where the image goes."""
SIZE = 56


def draw(shape: str, colour: str, rng: random.Random) -> Any:
    """A ``SIZE`` x ``SIZE`` RGB image: ``shape`` in ``colour`` at a random place and size, on grey."""
    from PIL import Image, ImageDraw

    grey = rng.randint(150, 200)
    img = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    d = ImageDraw.Draw(img)
    side = rng.randint(24, 40)
    x, y = rng.randint(2, SIZE - side - 2), rng.randint(2, SIZE - side - 2)
    box = (x, y, x + side, y + side)
    fill = COLOURS[colour]
    if shape == "square":
        d.rectangle(box, fill=fill)
    elif shape == "circle":
        d.ellipse(box, fill=fill)
    else:
        d.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    return img


def records(*, seed: int, count: int = 480) -> list[PromptRecord]:
    """``count`` prompts: each a drawn shape, asked (in turn) its colour or its shape."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        kind = ("colour", "shape")[i % 2]
        label = colour if kind == "colour" else shape
        out.append(PromptRecord(prompt=QUESTIONS[kind], label=label, images=(draw(shape, colour, rng),)))
    return out


def warmup_records(*, seed: int) -> list[tuple[PromptRecord, str]]:
    """``(prompt, response)`` pairs for the format warm-up: a word of the asked kind, drawn at random (right
    by chance only: the rule is left to reinforcement learning)."""
    rng = random.Random(seed)
    out = []
    for r in records(seed=seed):
        words = list(COLOURS) if r.prompt == QUESTIONS["colour"] else list(SHAPES)
        out.append((r, rng.choice(words)))
    return out


def reward_func(queries: list[str], prompts: list[str], labels: list[Any], **_: Any) -> dict:
    """1 when the response's first word is the label, else 0."""
    rewards = []
    for q, p, label in zip(queries, prompts, labels, strict=True):
        words = q[len(p) :].split()
        rewards.append(1.0 if words and words[0].strip(".,!") == str(label) else 0.0)
    return {"rewards": rewards, "scores": rewards}
