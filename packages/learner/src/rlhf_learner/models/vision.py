"""Vision-language models (the Qwen2-VL family): which are supported, their vision tower, and the inputs
their forward takes besides the token ids."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "FROZEN_TOWER_MODULES",
    "IDS_ONLY_TYPES",
    "VISION_LANGUAGE_TYPES",
    "check_vision_compile",
    "check_vision_language",
    "freeze_vision_tower",
    "is_vision_language",
    "packed_mrope_positions",
    "trained_parameters",
]

VISION_LANGUAGE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""``model_type`` s whose image inputs (``pixel_values``, ``image_grid_thw``) and M-RoPE positions the
learner handles, and which vLLM serves."""

IDS_ONLY_TYPES = ("qwen3_vl",)
"""``model_type`` s whose forward takes token ids or embeddings, not both: a placeholder token the policy
sampled is embedded there through a hook on the input embeddings, which ``torch.compile`` would not see
(their ``compile`` is refused)."""

FROZEN_TOWER_MODULES = r".*\.visual\.(?!merger|deepstack_merger).*"
"""Module names of the vision tower but its projectors (the patch merger, and Qwen3-VL's deepstack
mergers): no LoRA adapters there while it is frozen."""


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


def check_vision_compile(config: dict[str, Any], *, compile: bool) -> None:
    """Refuse ``compile`` for a model of :data:`IDS_ONLY_TYPES`, in one line."""
    if compile and config.get("model_type") in IDS_ONLY_TYPES:
        raise ValueError(
            f"compile: not for model_type {config.get('model_type')!r} (a placeholder token the policy "
            "samples is embedded through a hook that compiled code would skip)"
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


def trained_parameters(
    model: nn.Module, *, with_frozen_tower: bool = False
) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` s a weight sync sends: all of them, but for a vision-language model not the
    frozen vision tower's (engines load it from the same checkpoint, and it never changes), unless
    ``with_frozen_tower``: engines that drop their weights while asleep (vLLM's sleep level 2) need it
    again at every sync."""
    named = list(model.named_parameters())
    if with_frozen_tower or not is_vision_language(getattr(model, "config", None)):
        return named
    return [(n, p) for n, p in named if p.requires_grad or ".visual." not in f".{n}"]


def _rope_index(model: nn.Module) -> Any:
    """The model's own M-RoPE position builder (``get_rope_index``), under any wrapper (peft, compile)."""
    for module in model.modules():
        if hasattr(module, "get_rope_index"):
            return module.get_rope_index
    raise ValueError(f"{type(model).__name__}: no get_rope_index (not a Qwen2-VL-family model)")


def packed_mrope_positions(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor,
) -> torch.Tensor:
    """``[3, R, L]`` M-RoPE positions of packed rows (``position_ids`` restart at 0 per sequence), each
    sequence's as the model computes them for it alone; its images are the next ones of ``image_grid_thw``
    (one per run of image tokens in ``mm_token_type_ids``, in row order)."""
    if bool((position_ids[:, 0] != 0).any()):
        raise ValueError("position_ids: packed image rows must start a sequence at column 0")
    build = _rope_index(model)
    out = torch.zeros((3, *input_ids.shape), dtype=torch.long)
    ids, kinds, positions = input_ids.cpu(), mm_token_type_ids.cpu().long(), position_ids.cpu()
    taken, width = 0, input_ids.shape[1]
    starts = (positions == 0).nonzero().tolist()
    for k, (row, start) in enumerate(starts):
        end = starts[k + 1][1] if k + 1 < len(starts) and starts[k + 1][0] == row else width
        span = kinds[row, start:end]
        images = int(((span == 1) & (torch.nn.functional.pad(span, (1, 0))[:-1] != 1)).sum())  # runs
        if images == 0:
            out[:, row, start:end] = torch.arange(end - start)
            continue
        pos, _ = build(
            input_ids=ids[row, start:end][None],
            mm_token_type_ids=span[None],
            image_grid_thw=image_grid_thw[taken : taken + images].cpu(),
        )
        out[:, row, start:end] = pos[:, 0]
        taken += images
    if taken != image_grid_thw.shape[0]:
        raise ValueError(f"image_grid_thw: {image_grid_thw.shape[0]} images, the rows hold {taken}")
    return out.to(input_ids.device)
