"""Prompts with images, token in and token out.

An :class:`ImagePrompt` is a prompt's token ids as the model reads them, each image's placeholder already
expanded to that image's tokens (what the model's processor returns), with the images in order. It is a
``list`` of ids, so it goes wherever a prompt goes; the engines read its images. vLLM expands each
placeholder itself from the image, so it is given :meth:`ImagePrompt.engine_ids`, one placeholder per
image, and gives back exactly these ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["ImagePrompt", "prompt_images"]


class ImagePrompt(list):
    """Token ids (placeholders expanded) plus ``images``; ``image_token_counts[k]`` is how many
    ``image_token_id`` tokens image ``k`` takes. Pickles (to Ray actors) with its images."""

    images: tuple[Any, ...]
    image_token_id: int
    image_token_counts: tuple[int, ...]

    def __init__(
        self,
        token_ids: Iterable[int],
        *,
        images: Sequence[Any],
        image_token_id: int,
        image_token_counts: Sequence[int],
    ) -> None:
        super().__init__(int(t) for t in token_ids)
        self.images = tuple(images)
        self.image_token_id = int(image_token_id)
        self.image_token_counts = tuple(int(c) for c in image_token_counts)
        if len(self.images) != len(self.image_token_counts):
            raise ValueError(
                f"ImagePrompt: {len(self.images)} images but {len(self.image_token_counts)} token counts"
            )
        found = sum(1 for t in self if t == self.image_token_id)
        if found != sum(self.image_token_counts):
            raise ValueError(
                f"ImagePrompt: {found} image tokens in the ids, the images take {sum(self.image_token_counts)}"
            )

    def extended(self, token_ids: Iterable[int]) -> ImagePrompt:
        """This prompt followed by ``token_ids`` (text: no image tokens), with the same images."""
        return ImagePrompt(
            [*self, *token_ids],
            images=self.images,
            image_token_id=self.image_token_id,
            image_token_counts=self.image_token_counts,
        )

    def image_mask(self) -> list[bool]:
        """True on the tokens of the images (a placeholder token later in the ids, sampled, is text)."""
        out, left = [], sum(self.image_token_counts)
        for t in self:
            is_image = t == self.image_token_id and left > 0
            left -= is_image
            out.append(is_image)
        return out

    def engine_ids(self) -> list[int]:
        """The ids with each image's tokens collapsed to one placeholder (what an engine that runs the
        model's processor on the image expands again)."""
        out: list[int] = []
        counts = iter(self.image_token_counts)
        skip = 0
        for t in self:
            if skip:
                skip -= 1
                continue
            out.append(t)
            if t == self.image_token_id:
                skip = next(counts) - 1
        return out


def prompt_images(prompt: Sequence[int]) -> tuple[Any, ...]:
    """The images of a prompt (none for plain token ids)."""
    return prompt.images if isinstance(prompt, ImagePrompt) else ()
