"""Prompts: read from a JSONL file or a local ``datasets`` folder, tokenised, served in a seeded order
that a checkpoint can resume."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlhf_cli.data.images import IMAGE_PLACEHOLDER, ImageEncoder, count_placeholders, row_images
from rlhf_rollout import prompt_images

__all__ = [
    "PromptCursor",
    "PromptRecord",
    "PromptSet",
    "load_records",
    "read_rows",
    "seeded_order",
    "with_template",
]


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    prompt: str | list[dict]
    """Text, or chat messages (``[{"role": ..., "content": ...}]``)."""
    label: Any = None
    images: tuple[Any, ...] = ()
    """Its images (RGB PIL images), one per placeholder (``<image>`` in text, ``{"type": "image"}`` parts)."""


def load_records(
    path: Path,
    *,
    input_key: str,
    label_key: str | None,
    max_samples: int | None = None,
    flag: str = "--data.path",
    image_key: str | None = None,
    model_takes_images: bool = False,
) -> list[PromptRecord]:
    """Records from ``path`` (``.jsonl`` file or ``datasets.save_to_disk`` folder), with the images under
    ``image_key`` when a row has them. Errors name the file and line (JSONL) or row (datasets) and the
    missing key, image or placeholder."""
    path = Path(path)
    where, rows = read_rows(path, flag=flag)
    base = path if path.is_dir() else path.parent
    out: list[PromptRecord] = []
    for number, row in rows:
        if input_key not in row:
            raise ValueError(
                f"{path}, {where} {number}: no {input_key!r} key (--data.input_key); keys: {sorted(row)}"
            )
        if label_key is not None and label_key not in row:
            raise ValueError(
                f"{path}, {where} {number}: no {label_key!r} key (--data.label_key); keys: {sorted(row)}"
            )
        prompt = row[input_key]
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ValueError(
                f"{path}, {where} {number}: {input_key!r} must be non-empty text or a message list"
            )
        at = f"{path}, {where} {number}"
        images = prompt_row_images(
            row, image_key, prompt, base=base, where=at, model_takes_images=model_takes_images
        )
        label = row[label_key] if label_key is not None else None
        out.append(PromptRecord(prompt=prompt, label=label, images=images))
        if max_samples is not None and len(out) >= max_samples:
            break
    if not out:
        raise ValueError(f"{flag}: {str(path)!r} holds no prompts")
    return out


def prompt_row_images(
    row: dict, key: str | None, prompt: str | list[dict], *, base: Path, where: str, model_takes_images: bool
) -> tuple[Any, ...]:
    """A row's images under ``key``, checked against its prompt's placeholders and the model."""
    if key is None or row.get(key) in (None, []):
        return ()
    if not model_takes_images:
        raise ValueError(f"{where}: has images under {key!r} (--data.image_key), but the model is text-only")
    images = row_images(row, key, base=base, where=where)
    places = count_placeholders(prompt)
    if places != len(images):
        raise ValueError(
            f"{where}: {len(images)} image(s) under {key!r} but {places} placeholder(s) in the prompt "
            f'(\'{IMAGE_PLACEHOLDER}\' in text, or {{"type": "image"}} message parts)'
        )
    return images


def read_rows(path: Path, *, flag: str) -> tuple[str, Iterator[tuple[int, dict]]]:
    """``(where, rows)``: ``"line"`` and ``(line number, object)`` of a JSONL file, or ``"row"`` and
    ``(row index, row)`` of a ``datasets`` folder (its ``train`` split)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{flag}: {str(path)!r} does not exist")
    if path.is_dir():
        return "row", _dataset_rows(path, flag)
    return "line", _jsonl_rows(path)


def seeded_order(n: int, *, seed: int, epoch: int) -> list[int]:
    """The order of ``n`` items in ``epoch`` of a run seeded with ``seed``."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def _jsonl_rows(path: Path):
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}, line {number}: not UTF-8 text (byte {raw[err.start]:#04x})"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(row).__name__}")
            yield number, row


def _dataset_rows(path: Path, flag: str):
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(
            f"{flag}: {str(path)!r} is not a datasets folder saved with save_to_disk ({err})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ValueError(f"{flag}: {str(path)!r} has splits {list(ds)} but no 'train'")
        ds = ds["train"]
    yield from enumerate(ds)


@dataclass(kw_only=True)
class PromptCursor:
    """Where the data order stands: pass ``epoch`` of the seeded shuffle, position ``index`` in it."""

    epoch: int = 0
    index: int = 0


@dataclass(kw_only=True)
class PromptSet:
    """Tokenised prompts and their labels, served in an order shuffled by ``seed`` (a new order each epoch)."""

    token_ids: list[list[int]]
    labels: list[Any]
    seed: int
    cursor: PromptCursor = field(default_factory=PromptCursor)
    skipped: list[int] = field(default_factory=list)
    """Positions (in the source) of the prompts left out for not fitting the context."""
    encoder: ImageEncoder | None = None
    """The processor that built the image prompts (:class:`ImagePrompt` ids) and makes their pixels."""

    @property
    def has_images(self) -> bool:
        """Some prompts show images."""
        return any(prompt_images(ids) for ids in self.token_ids)

    @classmethod
    def from_records(
        cls,
        records: list[PromptRecord],
        tokenizer: Any,
        *,
        apply_chat_template: bool,
        seed: int,
        max_prompt_len: int,
        source: str,
        strict: bool = False,
        encoder: ImageEncoder | None = None,
    ) -> PromptSet:
        """Tokenise ``records`` (those with images by ``encoder``, the model's processor: their ids hold each
        image's tokens). A prompt of ``max_prompt_len`` tokens or more leaves no room to generate: it is
        left out and counted in ``skipped`` (``strict``: refused, naming it); an empty one, or a source left
        with no prompt, is refused."""
        if encoder is None and any(r.images for r in records):
            raise ValueError(f"{source}: prompts with images need a vision-language model's processor")
        ids = [
            encoder.prompt(r.prompt, r.images)
            if r.images and encoder is not None
            else encode_prompt(r.prompt, tokenizer, apply_chat_template=apply_chat_template)
            for r in records
        ]
        kept, skipped = [], []
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"{source}: prompt {i} is empty after tokenisation")
            if len(p) < max_prompt_len:
                kept.append(i)
            elif strict:
                raise ValueError(
                    f"{source}: prompt {i} has {len(p)} tokens; --rollout.max_model_len {max_prompt_len} leaves "
                    "no room (without --data.strict such prompts are skipped and counted)"
                )
            else:
                skipped.append(i)
        if not kept:
            raise ValueError(
                f"{source}: all {len(ids)} prompts have {max_prompt_len} tokens or more "
                f"(--rollout.max_model_len {max_prompt_len} leaves no room to generate)"
            )
        return cls(
            token_ids=[ids[i] for i in kept],
            labels=[records[i].label for i in kept],
            seed=seed,
            skipped=skipped,
            encoder=encoder,
        )

    def next_batch(self, size: int) -> tuple[list[list[int]], list[Any]]:
        """The next ``size`` prompts (wrapping into a new epoch as needed) and their labels."""
        picked: list[int] = []
        while len(picked) < size:
            order = seeded_order(len(self.token_ids), seed=self.seed, epoch=self.cursor.epoch)
            take = order[self.cursor.index : self.cursor.index + size - len(picked)]
            picked += take
            self.cursor.index += len(take)
            if self.cursor.index >= len(order):
                self.cursor = PromptCursor(epoch=self.cursor.epoch + 1, index=0)
        return [self.token_ids[i] for i in picked], [self.labels[i] for i in picked]


def with_template(records: list[PromptRecord], template: str | None, *, source: str) -> list[PromptRecord]:
    """Text prompts put in ``template`` at its ``{}`` (``--data.input_template``); a conversation is
    refused, naming it."""
    if template is None:
        return records
    out = []
    for i, r in enumerate(records):
        if not isinstance(r.prompt, str):
            raise ValueError(
                f"{source}: prompt {i} is a conversation; --data.input_template formats text prompts"
            )
        out.append(replace(r, prompt=template.replace("{}", r.prompt, 1)))
    return out


def encode_prompt(prompt: str | list[dict], tokenizer: Any, *, apply_chat_template: bool) -> list[int]:
    """Token ids of a prompt: the chat template with the generation prompt, or the plain text."""
    if isinstance(prompt, list) or apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
