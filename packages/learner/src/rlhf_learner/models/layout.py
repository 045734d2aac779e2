"""Rows as a model call takes them: laid out for the attention kernel, with the positions and image inputs
a vision-language model reads. Shared by the actor (log-probs) and the critic (values)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlhf_learner.models.loading import attn_implementation
from rlhf_learner.models.vision import IDS_ONLY_TYPES, is_vision_language, packed_mrope_positions
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """``(input_ids, keyword arguments, sampled placeholders)`` of a vision-language model's call on rows
    with images, laid out for the kernel. Padded rows: the model derives each row's M-RoPE positions from
    its ids, images and mask. Packed rows (``packed``: their restarting positions): each sequence's are
    computed here, and the keywords' ``position_ids`` are ``[4, R, L]``, the text positions before the three
    M-RoPE rows. A placeholder token outside ``mm_token_type_ids`` (one the policy sampled) is text: its id
    is hidden from the model's image placement (0), and it is embedded as the placeholder's text, from
    ``inputs_embeds`` given beside the ids or, for a model that takes one or the other
    (:data:`IDS_ONLY_TYPES`), through :class:`ModelCall`'s hook (its mask is returned for that)."""
    if all(v is None for v in images.values()):
        return input_ids, {}, None
    if any(v is None for v in images.values()):
        raise ValueError("pixel_values, image_grid_thw and mm_token_type_ids: give all or none")
    if not is_vision_language(model.config):
        raise ValueError("pixel_values: the model has no vision tower (a text-only model)")
    kinds = images["mm_token_type_ids"].reshape(input_ids.shape)  # type: ignore[union-attr]
    kwargs: dict[str, torch.Tensor] = dict(images, mm_token_type_ids=kinds)  # type: ignore[arg-type]
    if packed is not None:
        rope = packed_mrope_positions(model, input_ids, packed, kinds, kwargs["image_grid_thw"])
        kwargs["position_ids"] = torch.cat([packed[None], rope])
    sampled = (input_ids == int(model.config.image_token_id)) & (kinds == 0)
    if not sampled.any():
        return input_ids, kwargs, None
    if getattr(model.config, "model_type", None) in IDS_ONLY_TYPES:
        return input_ids.masked_fill(sampled, 0), kwargs, sampled
    kwargs["inputs_embeds"] = model.get_input_embeddings()(input_ids)
    return input_ids.masked_fill(sampled, 0), kwargs, None


@contextlib.contextmanager
def _embedded_as_placeholder(
    embedding: nn.Module, sampled: torch.Tensor, image: torch.Tensor
) -> Iterator[None]:
    """While open, ``embedding``'s output at ``sampled`` is its output at the first ``image`` position: the
    image placeholder token's own embedding (the model places the image features after embedding)."""
    first = image.flatten().nonzero()[0]

    def hook(_module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        own = out.reshape(-1, out.shape[-1])[first.to(out.device)]
        return torch.where(sampled.to(out.device).unsqueeze(-1), own, out)

    handle = embedding.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@dataclass(frozen=True, eq=False)
class ModelCall:
    """A model call on rows laid out for the kernel (see :func:`model_call`)."""

    ids: torch.Tensor
    """The token ids as laid out (what per-token outputs are computed against)."""
    starts: torch.Tensor | None
    """Packed rows: their restarting positions as laid out (each sequence's first token at 0); else None."""
    back: Callable[[torch.Tensor], torch.Tensor]
    """Puts a per-token output (``[R', L', ...]``) back as the caller's ``[R, L, ...]``."""
    kwargs: dict[str, Any]
    """The model call's keyword arguments: ids, mask, positions and images."""
    embedding: nn.Module | None = None
    sampled: torch.Tensor | None = None
    """Image placeholder tokens the policy sampled (text), given as id 0 and embedded as the placeholder."""

    def run(self, forward: Callable[..., Any]) -> Any:
        """``forward(**kwargs)`` (the model, or its trunk)."""
        if self.sampled is None or self.embedding is None:
            return forward(**self.kwargs)
        image = self.kwargs["mm_token_type_ids"] == 1
        with _embedded_as_placeholder(self.embedding, self.sampled, image):
            return forward(**self.kwargs)


def model_call(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None,
    packed: torch.Tensor | None,
    positions: torch.Tensor | None,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
) -> ModelCall:
    """Rows (padded, or ``packed`` with their restarting positions) as ``model`` is called on them: laid out
    for the attention kernel, with a vision-language model's positions and images (``pixel_values``,
    ``image_grid_thw``, ``mm_token_type_ids``: all or none, none for text)."""
    images = dict(
        pixel_values=pixel_values, image_grid_thw=image_grid_thw, mm_token_type_ids=mm_token_type_ids
    )
    pictured = pixel_values is not None
    ids, pos, model_pos, back = kernel_layout(model.config, input_ids, packed, positions, pictured=pictured)
    starts = pos if packed is not None else None
    model_ids, extra, sampled = image_inputs(model, ids, starts, images)
    if extra:  # M-RoPE (3D) positions: computed per packed sequence, or derived by the model
        model_pos = extra.pop("position_ids", None)
    kwargs = dict(input_ids=model_ids, attention_mask=attention_mask, position_ids=model_pos, use_cache=False)
    embedding = model.get_input_embeddings() if sampled is not None else None
    return ModelCall(ids, starts, back, kwargs | extra, embedding, sampled)
