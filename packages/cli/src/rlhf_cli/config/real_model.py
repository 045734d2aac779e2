"""Defaults for a real model: what ``rlhf ppo`` takes where the user set nothing and named a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "DISTILL_DEMO_DEFAULTS",
    "REAL_MODEL_DEFAULTS",
    "VLM_DEMO_DEFAULTS",
    "demo_defaults",
    "fill_unset",
    "model_positions",
]

REAL_MODEL_DEFAULTS = {
    "actor.lr": 1e-6,
    "critic.lr": 9e-6,
    "rollout.max_model_len": 2048,
    "rollout.max_new_tokens": 1024,
}
"""What an unset setting takes once --actor.pretrain names a model (OpenRLHF's defaults); the defaults
``--help`` shows fit the built-in demo's tiny model. The sequence length is held to the model's positions,
and the new tokens to half of it."""


VLM_DEMO_DEFAULTS = {"actor.lr": 1e-3, "train.num_steps": 100}
"""The image demo's own defaults (``--train.demo_model vlm``): its tiny vision-language model learns the image
task more slowly, and collapses onto one answer at the text demo's learning rate."""


DISTILL_DEMO_DEFAULTS = {"algo.distill.top_k": 16}
"""The distillation demo's own defaults (``--algo.advantage.estimator distill`` with no model given): the
teacher's top 16 at every sampled token, the dense term that beats GRPO on the built-in task."""


def demo_defaults(demo_model: str, *, distillation: bool) -> dict[str, Any]:
    """What a built-in demo sets unless the user did: the image demo's, or the distillation demo's."""
    return VLM_DEMO_DEFAULTS if demo_model == "vlm" else DISTILL_DEMO_DEFAULTS if distillation else {}


def fill_unset(cfg: Any, defaults: dict[str, Any]) -> None:
    """Set each ``section.key`` (or ``section.sub.key``) of ``defaults`` that the user left unset."""
    for path, value in defaults.items():
        name, *rest = path.split(".")
        section = getattr(cfg, name)
        if (filled := _filled(section, rest, value)) is not section:  # (assigning validates cfg again)
            setattr(cfg, name, filled)


def _filled(section: Any, path: list[str], value: Any) -> Any:
    """``section`` itself if the user set ``path`` (``key`` or ``sub.key``), else a copy with ``value``."""
    head, *rest = path
    if not rest:
        return section if head in section.model_fields_set else section.model_copy(update={head: value})
    inner = getattr(section, head)
    filled = _filled(inner, rest, value)
    return section if filled is inner else section.model_copy(update={head: filled})


def model_positions(folder: str) -> int | None:
    """The longest sequence a model folder's ``config.json`` allows (its text model's, for a
    vision-language one); None when it cannot say (no such file yet: the model check says why later)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    positions = text.get("max_position_embeddings")
    return positions if isinstance(positions, int) and positions > 0 else None
