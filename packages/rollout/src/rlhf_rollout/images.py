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
    ``image_token_id`` tokens image ``k`` takes. Built from a processor's output every placeholder token is
    an image's; text appended later (:meth:`extended`, a sampled turn) holds none, even a placeholder
    token the policy sampled. Pickles (to Ray actors) with its images."""

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
        image_mask: Sequence[bool] | None = None,
    ) -> None:
        super().__init__(int(t) for t in token_ids)
        self.images = tuple(images)
        self.image_token_id = int(image_token_id)
        self.image_token_counts = tuple(int(c) for c in image_token_counts)
        mask = [t == self.image_token_id for t in self] if image_mask is None else list(image_mask)
        self._image_mask = mask
        if len(self.images) != len(self.image_token_counts):
            raise ValueError(
                f"ImagePrompt: {len(self.images)} images but {len(self.image_token_counts)} token counts"
            )
        if len(mask) != len(self) or sum(mask) != sum(self.image_token_counts):
            raise ValueError(
                f"ImagePrompt: {sum(mask)} image tokens in the ids, the images take {sum(self.image_token_counts)}"
            )

    def image_mask(self) -> list[bool]:
        """True on the tokens of the images (a placeholder token sampled into the ids is text)."""
        return list(self._image_mask)

    def extended(self, token_ids: Iterable[int]) -> ImagePrompt:
        """This prompt followed by ``token_ids`` (text: no image tokens), with the same images."""
        ids = list(token_ids)
        return ImagePrompt(
            [*self, *ids],
            images=self.images,
            image_token_id=self.image_token_id,
            image_token_counts=self.image_token_counts,
            image_mask=[*self._image_mask, *([False] * len(ids))],
        )

    def joined(self, other: ImagePrompt) -> ImagePrompt:
        """This prompt followed by ``other`` (e.g. an environment's answer with its own images)."""
        return ImagePrompt(
            [*self, *other],
            images=self.images + other.images,
            image_token_id=self.image_token_id,
            image_token_counts=self.image_token_counts + other.image_token_counts,
            image_mask=self._image_mask + other.image_mask(),
        )

    def engine_ids(self) -> list[int]:
        """The ids with each image's tokens collapsed to one placeholder (what an engine that runs the
        model's processor on the image expands again)."""
        out: list[int] = []
        counts = iter(self.image_token_counts)
        skip = 0
        for t, is_image in zip(self, self._image_mask, strict=True):
            if skip:
                skip -= 1
                continue
            out.append(t)
            if is_image:
                skip = next(counts) - 1
        return out


def prompt_images(prompt: Sequence[int]) -> tuple[Any, ...]:
    """The images of a prompt (none for plain token ids)."""
    return prompt.images if isinstance(prompt, ImagePrompt) else ()
