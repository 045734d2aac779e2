"""The built-in task of ``rlhf ppo`` with no model given: answer with the larger of two digits.

Verifiable (reward 1 for the right digit, else 0), small enough for a tiny model trained from scratch on
two CPU cores: a short supervised warm-up teaches the answer format, reinforcement learning the rule.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from rlhf_cli.data.prompts import PromptRecord

__all__ = [
    "DATA_KINDS",
    "TASK_NAME",
    "answer",
    "build_demo_model",
    "builtin_task",
    "data_rows",
    "demo_num_params",
    "records",
    "reward_func",
    "warmup_records",
    "write_data",
]

TASK_NAME = "larger-digit"
_DIGIT = re.compile(r"\d")


def _prompt(a: int, b: int) -> str:
    return f"max {a} {b} ="


def answer(a: int, b: int) -> str:
    return str(max(a, b))


def records(*, seed: int) -> list[PromptRecord]:
    """Every ordered pair of distinct digits (90 prompts), in an order shuffled by ``seed``."""
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    random.Random(seed).shuffle(pairs)
    return [PromptRecord(prompt=_prompt(a, b), label=answer(a, b)) for a, b in pairs]


def warmup_records(*, seed: int) -> list[tuple[str, str]]:
    """(prompt, response) pairs for the format warm-up: a digit from the prompt, right or not."""
    rng = random.Random(seed)
    out = []
    for r in records(seed=seed):
        a, b = _digits(str(r.prompt))
        out.append((str(r.prompt), f" {rng.choice((a, b))}"))
    return out


def reward_func(queries: list[str], prompts: list[str], labels: list[Any], **_: Any) -> dict:
    """1 when the first digit of the response is the label, else 0."""
    rewards = []
    for q, p, label in zip(queries, prompts, labels, strict=True):
        m = _DIGIT.search(q[len(p) :])
        rewards.append(1.0 if m is not None and m.group() == str(label) else 0.0)
    return {"rewards": rewards, "scores": rewards}


def _digits(prompt: str) -> tuple[int, int]:
    a, b = (int(x) for x in prompt.split()[1:3])
    return a, b


def data_rows(kind: str, *, seed: int) -> list[dict]:
    """The task as training data in the offline commands' default formats:

    - ``sft``: ``{"prompt", "response"}``, the response a digit from the prompt, right or not (the format);
    - ``preferences``: ``{"prompt", "chosen", "rejected"}``, the larger digit preferred to the smaller;
    - ``kto``: ``{"prompt", "completion", "label"}``, each prompt once with its right answer (desirable)
      and once with the wrong one;
    - ``prompts``: ``{"input", "label"}`` for ``rlhf ppo --data.path``.
    """
    recs = records(seed=seed)
    if kind == "sft":
        return [{"prompt": p, "response": r} for p, r in warmup_records(seed=seed)]
    if kind == "preferences":
        out = []
        for r in recs:
            a, b = _digits(str(r.prompt))
            out.append({"prompt": r.prompt, "chosen": f" {max(a, b)}", "rejected": f" {min(a, b)}"})
        return out
    if kind == "kto":
        out = []
        for r in recs:
            a, b = _digits(str(r.prompt))
            out.append({"prompt": r.prompt, "completion": f" {max(a, b)}", "label": True})
            out.append({"prompt": r.prompt, "completion": f" {min(a, b)}", "label": False})
        return out
    if kind == "prompts":
        return [{"input": r.prompt, "label": r.label} for r in recs]
    raise ValueError(f"unknown data kind {kind!r}; expected one of {DATA_KINDS}")


DATA_KINDS = ("sft", "preferences", "kto", "prompts")


def write_data(kind: str, path: Path, *, seed: int) -> Path:
    """``data_rows(kind)`` as a JSONL file at ``path``."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in data_rows(kind, seed=seed)))
    return path


DEMO_MODELS = {
    "small": {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256},
    "large": {"num_hidden_layers": 3, "hidden_size": 192, "intermediate_size": 384},
    "vlm": {},  # the tiny Qwen2-VL: its language model has the tiny model's default shape
}
"""The demo's tiny models (one tokenizer): the small one is the default, the large one the distillation
demo's teacher (``--train.demo_model``)."""


def build_demo_model(directory: Path, size: str = "small") -> Path:
    """The tiny model of the demo (built offline; the same folder is reused when it exists); ``vlm``: the
    tiny Qwen2-VL of the image task."""
    from rlhf_cli.demo.tiny_model import TinyModelSpec, build_tiny_model

    if (directory / "config.json").is_file():
        return directory
    if size == "vlm":
        from rlhf_cli.demo.tiny_vlm import build_tiny_vlm

        return build_tiny_vlm(directory)
    return build_tiny_model(directory, TinyModelSpec(**DEMO_MODELS[size]))


def builtin_task(demo_model: str = "small") -> ModuleType:
    """The built-in task of a demo model: this one (larger digit), or for ``vlm`` the image task
    (:mod:`rlhf_cli.demo.shapes`). Both give ``TASK_NAME``, ``records``, ``warmup_records`` and
    ``reward_func``."""
    if demo_model == "vlm":
        from rlhf_cli.demo import shapes

        return shapes
    return sys.modules[__name__]


def demo_num_params(size: str = "small") -> int:
    """Parameters of a demo model, computed from its shape without building it."""
    from rlhf_cli.demo.tiny_model import TinyModelSpec

    if size == "vlm":
        from rlhf_cli.demo.tiny_vlm import tiny_vlm_num_params

        return tiny_vlm_num_params()
    spec = TinyModelSpec(**DEMO_MODELS[size])
    h, i, layers, v = spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers, spec.vocab_size
    kv = h // spec.num_attention_heads * spec.num_key_value_heads
    attn = 2 * h * h + 2 * h * kv + h + 2 * kv  # q and o; k and v; q/k/v biases (qwen2)
    return v * h + layers * (attn + 3 * h * i + 2 * h) + h
