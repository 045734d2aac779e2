"""Rows as a model call takes them: laid out for the attention kernel, with the positions and image inputs
a vision-language model reads. Shared by the actor (log-probs) and the critic (values)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from rlhf_learner.models.loading import attn_implementation
from rlhf_learner.models.vision import is_vision_language, packed_mrope_positions
from rlhf_learner.packing import for_kernel

__all__ = ["ModelCall", "image_inputs", "kernel_layout", "model_call"]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def kernel_layout(
    config: Any,
    input_ids: torch.Tensor,
    packed: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    *,
    pictured: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, Any]:
    """Rows as the attention kernel takes them: ``(ids, positions, the positions the model is given, how
    to put per-token outputs back)``. A vision-language model reads packed rows from text positions put
    before its three M-RoPE rows (else its mask would cross the packed sequences); rows with images
    (``pictured``) keep their tokens' order."""
    if packed is None:
        return input_ids, position_ids, position_ids, _same
    kernel = attn_implementation(config)
    ids, pos, back = for_kernel(input_ids, packed, attn_implementation=kernel, keep_order=pictured)
    model_pos = torch.cat([pos[None], pos[None].expand(3, *pos.shape)]) if is_vision_language(config) else pos
    return ids, pos, model_pos, back


def image_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    packed: torch.Tensor | None,
    images: dict[str, torch.Tensor | None],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(input_ids, keyword arguments)`` of a vision-language model's call on rows with images, laid out
    for the kernel. Padded rows: the model derives each row's M-RoPE positions from its ids, images and
    mask. Packed rows (``packed``: their restarting positions): each sequence's are computed here, and the
    keywords' ``position_ids`` are ``[4, R, L]``, the text positions before the three M-RoPE rows. A
    placeholder token outside ``mm_token_type_ids`` (one the policy sampled) is text: it is embedded as
    such and hidden from the model's image placement."""
    if all(v is None for v in images.values()):
        return input_ids, {}
    if any(v is None for v in images.values()):
        raise ValueError("pixel_values, image_grid_thw and mm_token_type_ids: give all or none")
    if not is_vision_language(model.config):
        raise ValueError("pixel_values: the model has no vision tower (a text-only model)")
    kinds = images["mm_token_type_ids"].reshape(input_ids.shape)  # type: ignore[union-attr]
    kwargs: dict[str, torch.Tensor] = dict(images, mm_token_type_ids=kinds)  # type: ignore[arg-type]
    if packed is not None:
        rope = packed_mrope_positions(model, input_ids, packed, kinds, kwargs["image_grid_thw"])
        kwargs["position_ids"] = torch.cat([packed[None], rope])
    text = (input_ids == int(model.config.image_token_id)) & (kinds == 0)
    if text.any():
        kwargs["inputs_embeds"] = model.get_input_embeddings()(input_ids)
        input_ids = input_ids.masked_fill(text, 0)
    return input_ids, kwargs


class ModelCall(NamedTuple):
    """A model call on rows laid out for the kernel (see :func:`model_call`)."""

    ids: torch.Tensor
    """The token ids as laid out (what per-token outputs are computed against)."""
    starts: torch.Tensor | None
    """Packed rows: their restarting positions as laid out (each sequence's first token at 0); else None."""
    back: Callable[[torch.Tensor], torch.Tensor]
    """Puts a per-token output (``[R', L', ...]``) back as the caller's ``[R, L, ...]``."""
    kwargs: dict[str, Any]
    """The model call's keyword arguments: ids, mask, positions and images."""


def model_call(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None,
    packed: torch.Tensor | None,
    positions: torch.Tensor | None,
    images: dict[str, torch.Tensor | None],
) -> ModelCall:
    """Rows (padded, or ``packed`` with their restarting positions) as ``model`` is called on them: laid out
    for the attention kernel, with a vision-language model's positions and ``images`` (``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids``, all None for text)."""
    pictured = images.get("pixel_values") is not None
    ids, pos, model_pos, back = kernel_layout(model.config, input_ids, packed, positions, pictured=pictured)
    starts = pos if packed is not None else None
    model_ids, extra = image_inputs(model, ids, starts, images)
    if extra:  # M-RoPE (3D) positions: computed per packed sequence, or derived by the model
        model_pos = extra.pop("position_ids", None)
    kwargs = dict(input_ids=model_ids, attention_mask=attention_mask, position_ids=model_pos, use_cache=False)
    return ModelCall(ids, starts, back, kwargs | extra)
