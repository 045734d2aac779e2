"""Vision-language models (the Qwen2-VL family): which are supported, their vision tower, and the inputs
their forward takes besides the token ids."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = [
    "FROZEN_TOWER_MODULES",
    "VISION_LANGUAGE_TYPES",
    "check_vision_language",
    "freeze_vision_tower",
    "is_vision_language",
    "trained_parameters",
]

VISION_LANGUAGE_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""``model_type`` s whose image inputs (``pixel_values``, ``image_grid_thw``) and M-RoPE positions the
learner handles, and which vLLM serves. (Qwen3-VL is not among them yet: its forward takes token ids or
embeddings, not both, which a placeholder token the policy sampled needs here.)"""

FROZEN_TOWER_MODULES = r".*\.visual\.(?!merger).*"
"""Module names of the vision tower but its projector (the patch merger): no LoRA adapters there while it
is frozen."""


def is_vision_language(config: dict[str, Any] | Any) -> bool:
    """A config (``config.json`` as a dict, or a transformers config) with a vision tower."""
    if isinstance(config, dict):
        return config.get("vision_config") is not None
    return getattr(config, "vision_config", None) is not None


def check_vision_language(config: dict[str, Any], *, where: str) -> None:
    """Refuse, in one line naming ``where``, a vision-language model outside :data:`VISION_LANGUAGE_TYPES`."""
    kind = config.get("model_type")
    if kind not in VISION_LANGUAGE_TYPES:
        raise ValueError(
            f"{where}: vision-language model_type {kind!r} is not supported; supported: "
            f"{', '.join(VISION_LANGUAGE_TYPES)}"
        )


def _is_projector(name: str) -> bool:
    return "merger" in name  # Qwen2-VL family: the patch merger (and Qwen3-VL's deepstack mergers)


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop gradients to the vision tower's parameters, the projector (patch merger) excepted; return how
    many tensors were frozen. The language model and the projector train."""
    frozen = 0
    for name, p in model.named_parameters():
        if ".visual." in f".{name}" and not _is_projector(name):
            p.requires_grad_(False)
            frozen += 1
    return frozen


def trained_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` s a weight sync sends: all of them, but for a vision-language model not the
    frozen vision tower's (engines load it from the same checkpoint, and it never changes)."""
    named = list(model.named_parameters())
    if not is_vision_language(getattr(model, "config", None)):
        return named
    return [(n, p) for n, p in named if p.requires_grad or ".visual." not in f".{n}"]
