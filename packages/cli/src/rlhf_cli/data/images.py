"""Images in the data: read from a row (paths, base64 data URIs, a ``datasets`` ``Image`` feature), placed in
the prompt at its placeholders, and turned by the model's processor into the prompt's token ids (each image's
placeholder expanded to its tokens) and the pixels the learner's forward takes."""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rlhf_rollout import ImagePrompt

__all__ = [
    "IMAGE_PLACEHOLDER",
    "ExampleImages",
    "ImageEncoder",
    "ImageInputs",
    "ImageSequence",
    "check_sharded_mix",
    "count_placeholders",
    "image_encoder",
    "row_images",
    "split_sequences",
]

IMAGE_PLACEHOLDER = "<image>"
"""Where an image goes in a text prompt (chat messages use ``{"type": "image"}`` parts instead)."""


@dataclass(frozen=True, kw_only=True)
class ImageInputs:
    """One sequence's images as the model's forward takes them."""

    pixel_values: torch.Tensor
    """``[patches, dim]``: the processor's flattened patches of every image, in order."""
    image_grid_thw: torch.Tensor
    """``[images, 3]``: each image's patch grid (time, height, width)."""
    positions: torch.Tensor
    """Where the images' tokens are in the sequence (a sampled placeholder token is text, not an image)."""

    @staticmethod
    def kinds(item: ImageInputs | None, length: int) -> torch.Tensor:
        """``[length]`` ``mm_token_type_ids`` of one sequence: 1 on its images' tokens."""
        out = torch.zeros(length, dtype=torch.int32)
        if item is not None:
            out[item.positions] = 1
        return out

    @staticmethod
    def pixels(items: Sequence[ImageInputs | None]) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` of sequences' images, in their order."""
        present = [i for i in items if i is not None]
        return {
            "pixel_values": torch.cat([i.pixel_values for i in present]),
            "image_grid_thw": torch.cat([i.image_grid_thw for i in present]),
        }

    @staticmethod
    def joined(items: Sequence[ImageInputs | None], width: int) -> dict[str, torch.Tensor]:
        """The images of padded rows (``width`` tokens), one sequence each: :meth:`pixels` in row order, and
        ``mm_token_type_ids`` (1 on each row's image tokens)."""
        kinds = torch.stack([ImageInputs.kinds(item, width) for item in items])
        return ImageInputs.pixels(items) | {"mm_token_type_ids": kinds}


@dataclass(frozen=True, eq=False)
class ExampleImages:
    """A training example's images (``rlhf sft``, ``dpo``), kept decoded: their pixels are made when a batch
    holds the example (:meth:`inputs`), so a data set's pixels are never all in memory at once."""

    images: tuple[Any, ...]
    positions: torch.Tensor
    """Where the images' tokens are in the example's ``token_ids``."""
    encoder: ImageEncoder
    """The processor that makes the pixels."""

    def inputs(self) -> ImageInputs:
        """The images' :class:`ImageInputs`, their pixels made now."""
        pixel_values, grid = self.encoder.pixels(self.images)
        if int(grid.prod(-1).sum()) // self.encoder.merge**2 != self.positions.numel():
            raise ValueError(
                f"the images take other token counts than the {self.positions.numel()} they were given"
            )
        return ImageInputs(pixel_values=pixel_values, image_grid_thw=grid, positions=self.positions)


@dataclass(frozen=True)
class ImageSequence:
    """A sequence to score whose tokens hold images: its ids and its images' pixels."""

    token_ids: torch.Tensor
    images: ImageInputs


def split_sequences(
    sequences: Sequence[torch.Tensor | ImageSequence],
) -> tuple[list[torch.Tensor], list[ImageInputs | None]]:
    """The token ids of sequences to score, and each one's images (None for a text sequence)."""
    ids = [s.token_ids if isinstance(s, ImageSequence) else s for s in sequences]
    return ids, [s.images if isinstance(s, ImageSequence) else None for s in sequences]


def check_sharded_mix(pictured: int, total: int, *, learner: Any, ranks: int, what: str) -> None:
    """Refuse, in one line, data that mixes rows with and without images when each forward gathers the
    model's parameters over several data-parallel ranks (``learner``: the group's ``StrategyOptions``; e.g.
    fsdp2, ZeRO-3): a rank whose micro-batch has no image would skip the vision tower's gathers that the
    others wait in."""
    from rlhf_learner.strategy import training_backend

    gathers = training_backend(learner.backend).gathers_in_forward(learner)
    if gathers and ranks > 1 and 0 < pictured < total:
        raise ValueError(
            f"{what}: {pictured} of {total} rows have images; with parameters gathered in each forward over "
            f"{ranks} data-parallel ranks ({learner.backend}, zero_stage {learner.zero_stage}) every row needs "
            "one (or none may have one), or train on one rank or with deepspeed zero_stage 2"
        )


def row_images(row: dict, key: str, *, base: Path, where: str) -> tuple[Any, ...]:
    """The images of a data row under ``key`` (one or a list; absent or empty: none), decoded to RGB.

    Each is a path (relative to ``base``, the data file's folder), a ``data:image/...;base64,`` URI, a PIL
    image or a ``{"bytes", "path"}`` dict (a ``datasets`` ``Image`` feature). ``where`` names the row in
    errors (``file, line N``)."""
    value = row.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(_image(v, base=base, where=f"{where}: image {k} of {key!r}") for k, v in enumerate(values))


def _image(value: Any, *, base: Path, where: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        data, name = value.get("bytes"), value.get("path")
    elif isinstance(value, str) and value.startswith("data:"):
        head, _, payload = value.partition(",")
        try:
            data, name = base64.b64decode(payload, validate=True), head
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: a data URI whose base64 does not decode") from None
    elif isinstance(value, str):
        data, name = None, value
    else:
        raise ValueError(f"{where}: expected a path, a data URI or an image, got {type(value).__name__}")
    if data is None:
        path = Path(name) if Path(name).is_absolute() else base / name
        if not path.is_file():
            raise ValueError(f"{where}: {str(path)!r} does not exist")
        data = path.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{where}: {str(name)[:80]!r} does not decode as an image ({err})") from None


def count_placeholders(prompt: str | list[dict]) -> int:
    """Image places in a prompt: ``<image>`` in text (also inside a message's text), or image parts."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    n = 0
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for part in parts:
            if isinstance(part, dict) and part.get("type") == "image":
                n += 1
            elif isinstance(part, dict) and part.get("type") == "text":
                n += str(part.get("text", "")).count(IMAGE_PLACEHOLDER)
    return n


def _parts(text: str) -> list[dict]:
    """Text with ``<image>`` placeholders as chat content parts."""
    out: list[dict] = []
    for k, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if k:
            out.append({"type": "image"})
        if piece:
            out.append({"type": "text", "text": piece})
    return out


def _messages(prompt: str | list[dict]) -> list[dict]:
    """A prompt as chat messages whose contents are parts (a text prompt: one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": _parts(prompt)}]
    out = []
    for m in prompt:
        content = m.get("content")
        if isinstance(content, str):
            content = _parts(content)
        elif isinstance(content, list):
            content = [
                q
                for part in content
                for q in (_parts(part["text"]) if part.get("type") == "text" else [part])
            ]
        out.append({**m, "content": content})
    return out


def image_encoder(model_dir: str | Path) -> ImageEncoder | None:
    """The processor of a vision-language model folder (None for a text-only model)."""
    from rlhf_learner.models import check_model_dir, is_vision_language

    config = check_model_dir(model_dir, need_causal_lm=False, need_tokenizer=False)
    return ImageEncoder.for_model(model_dir) if is_vision_language(config) else None


class ImageEncoder:
    """A vision-language model's processor: prompts with images to :class:`ImagePrompt` s, and images to
    the pixels its forward takes. The prompt is rendered with the processor's chat template (a text prompt
    as one user message) and tokenised once; the ids are the processor's, placeholders expanded."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        tok = processor.tokenizer
        self.image_token_id = int(tok.convert_tokens_to_ids(processor.image_token))
        self.merge = int(processor.image_processor.merge_size)

    @classmethod
    def for_model(cls, model_dir: str | Path) -> ImageEncoder:
        from transformers import AutoProcessor

        return cls(AutoProcessor.from_pretrained(str(model_dir)))

    def prompt(
        self, prompt: str | list[dict], images: Sequence[Any], *, add_generation_prompt: bool = True
    ) -> ImagePrompt:
        """The prompt's ids (its images' tokens expanded), rendered by the chat template with the generation
        prompt (``add_generation_prompt=False``: a whole conversation)."""
        text = self.processor.apply_chat_template(
            _messages(prompt), add_generation_prompt=add_generation_prompt, tokenize=False
        )
        out = self.processor(text=[text], images=list(images) or None, return_tensors="pt")
        grid = out.get("image_grid_thw")
        counts = [] if grid is None else (grid.prod(-1) // self.merge**2).tolist()
        return ImagePrompt(
            out["input_ids"][0].tolist(),
            images=images,
            image_token_id=self.image_token_id,
            image_token_counts=counts,
        )

    def pixels(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values, image_grid_thw)`` of ``images``, as the processor makes them."""
        out = self.processor.image_processor(images=list(images), return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def inputs(
        self,
        images: Sequence[Any],
        token_ids: torch.Tensor,
        sampled: torch.Tensor,
        pixels: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> ImageInputs:
        """The :class:`ImageInputs` of a sequence holding ``images``: their image tokens are the placeholder
        tokens the policy did not sample (``sampled``: its action mask). ``pixels``: :meth:`pixels`' result
        when already made (a prompt's samples share it)."""
        pixel_values, grid = pixels if pixels is not None else self.pixels(images)
        positions = self._positions(token_ids, sampled, int(grid.prod(-1).sum()) // self.merge**2)
        return ImageInputs(pixel_values=pixel_values, image_grid_thw=grid, positions=positions)

    def _positions(self, token_ids: torch.Tensor, sampled: torch.Tensor, want: int) -> torch.Tensor:
        """The image tokens of a sequence (placeholder tokens not sampled), checked to be ``want``."""
        positions = ((token_ids == self.image_token_id) & ~sampled.bool()).nonzero().flatten()
        if positions.numel() != want:
            raise ValueError(f"a sequence holds {positions.numel()} image tokens; its images take {want}")
        return positions

    def token_counts(self, images: Sequence[Any]) -> list[int]:
        """Each image's token count, from its size by the processor's own resize rule (no pixels made; a
        processor that does not resize makes them, for their grids)."""
        ip = self.processor.image_processor
        if not getattr(ip, "do_resize", True) or not hasattr(ip, "get_number_of_image_patches"):
            return (self.pixels(images)[1].prod(-1) // self.merge**2).tolist() if images else []
        return [ip.get_number_of_image_patches(i.height, i.width) // self.merge**2 for i in images]

    def _expanded(self, text: str, counts: Sequence[int]) -> list[int]:
        """``text``'s ids with its k-th image token repeated ``counts[k]`` times, as the processor expands
        it (the image token is a special token: it tokenises alone)."""
        out: list[int] = []
        ids = self.processor.tokenizer(text)["input_ids"]
        if ids.count(self.image_token_id) != len(counts):
            places = ids.count(self.image_token_id)
            raise ValueError(f"the rendered text has {places} image places for {len(counts)} images")
        k = 0
        for t in ids:
            out += [t] * (counts[k] if t == self.image_token_id else 1)
            k += t == self.image_token_id
        return out

    def example(
        self,
        prompt: str | list[dict] | None,
        response: str | list[dict],
        images: Sequence[Any],
        *,
        train_on_prompt: bool = False,
    ) -> dict[str, Any]:
        """``token_ids``, ``loss_mask`` and ``images`` (:class:`ExampleImages`: no pixels yet) of a training
        example with images: the conversation rendered by the chat template, each image's placeholder
        expanded to its token count, known from the image's size (the response is the last assistant turn:
        text, or the last message of a message list)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        messages += (
            list(response) if isinstance(response, list) else [{"role": "assistant", "content": response}]
        )
        if len(messages) < 2 or messages[-1].get("role") != "assistant" or not messages[-1].get("content"):
            raise ValueError("a conversation must end with a non-empty assistant message (the response)")
        counts = self.token_counts(images)
        render = self.processor.apply_chat_template
        p = self._expanded(
            render(_messages(messages[:-1]), add_generation_prompt=True, tokenize=False), counts
        )
        full = self._expanded(
            render(_messages(messages), add_generation_prompt=False, tokenize=False), counts
        )
        if full[: len(p)] != p:
            raise ValueError("the chat template renders the prompt differently inside the conversation")
        eos = self.processor.tokenizer.eos_token_id
        ids = torch.tensor(full if eos in full[len(p) :] else [*full, eos], dtype=torch.long)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[1 if train_on_prompt else len(p) :] = True
        positions = self._positions(ids, torch.zeros_like(mask), sum(counts))
        mask[positions] = False  # an image's tokens are input, never a target
        return {"token_ids": ids, "loss_mask": mask, "images": ExampleImages(tuple(images), positions, self)}

    def feedback(self, text: str, images: Sequence[Any], ended_with_eos: bool) -> ImagePrompt:
        """An environment's feedback showing ``images`` (one per ``<image>`` in ``text``) as a user turn and
        the generation prompt, after EOS when the model's turn did not end with it (as the text feedback)."""
        if count_placeholders(text) != len(images):
            raise ValueError(
                f"environment feedback shows {len(images)} image(s) but has {count_placeholders(text)} "
                f"'{IMAGE_PLACEHOLDER}' placeholder(s)"
            )
        turn = self.prompt(text, images)
        tok = self.processor.tokenizer
        sep = tok.encode("\n", add_special_tokens=False)
        prefix = sep if ended_with_eos else [tok.eos_token_id, *sep]
        return ImagePrompt(
            [*prefix, *turn],
            images=turn.images,
            image_token_id=self.image_token_id,
            image_token_counts=turn.image_token_counts,
            image_mask=[False] * len(prefix) + turn.image_mask(),
        )
