"""Training examples of the offline commands (``sft``, ``rm``, ``dpo``, ``kto``): read from a JSONL file
or a local ``datasets`` folder, tokenised once, served in a seeded order a checkpoint can resume.

Formats (key names are flags):

- SFT: ``{"prompt": ..., "response": ...}``, or ``{"messages": [...]}`` (the chat template; the last
  message is the response).
- Preferences (``rm``, ``dpo``): ``{"prompt": ..., "chosen": ..., "rejected": ...}``; ``chosen`` /
  ``rejected`` are response texts, or whole conversations (message lists) without ``prompt``.
- KTO: ``{"prompt": ..., "completion": ..., "label": true|false}`` (desirable or not).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from rlhf_cli.config.offline import ExampleData, KTOData, PairData, SFTData
from rlhf_cli.data.images import ExampleImages, ImageEncoder, ImageSequence
from rlhf_cli.data.prompts import PromptCursor, encode_prompt, prompt_row_images, read_rows, seeded_order

__all__ = [
    "Example",
    "ExampleSet",
    "KTOExample",
    "PreferencePair",
    "encode_example",
    "load_kto",
    "load_pairs",
    "load_sft",
    "mismatched_partners",
    "split_heldout",
]

E = TypeVar("E")


@dataclass(frozen=True, kw_only=True)
class Example:
    """One tokenised prompt + response."""

    token_ids: torch.Tensor
    """``[T]`` prompt then response (ending with EOS)."""
    loss_mask: torch.Tensor
    """``[T]`` True on the tokens trained on: the response (or every token after the first)."""
    images: ExampleImages | None = None
    """The images whose tokens ``token_ids`` holds (vision-language models); pixels made per batch."""

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def scored(self) -> torch.Tensor | ImageSequence:
        """What a group's forward scores: the token ids, with the images when there are some."""
        return self.token_ids if self.images is None else ImageSequence(self.token_ids, self.images.inputs())


@dataclass(frozen=True, kw_only=True)
class PreferencePair:
    chosen: Example
    rejected: Example
    ref_logp: tuple[float, float] | None = None
    """The reference's summed response log-probs of (chosen, rejected), once computed."""

    @property
    def sequences(self) -> tuple[Example, Example]:
        return self.chosen, self.rejected


@dataclass(frozen=True, kw_only=True)
class KTOExample:
    example: Example
    desirable: bool
    mismatched: Example
    """This prompt with another example's response: the KL reference point's sample."""
    ref_logp: tuple[float, float] | None = None
    """The reference's summed response log-probs of (example, mismatched), once computed."""

    @property
    def sequences(self) -> tuple[Example, Example]:
        return self.example, self.mismatched


class _Source:
    """Where a row came from, for error messages: ``file, line N`` or ``folder, row N``."""

    def __init__(self, path: Path, where: str, number: int) -> None:
        self.path = path
        self.text = f"{path}, {where} {number}"

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.text}: {message}")


def _messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def encode_example(
    prompt: str | list[dict] | None,
    response: str | list[dict],
    tokenizer: Any,
    *,
    apply_chat_template: bool,
    train_on_prompt: bool = False,
) -> Example:
    """Token ids and loss mask of a prompt and its response.

    Text: the prompt as :func:`rlhf_cli.data.encode_prompt` renders it, then the response's tokens and
    EOS. A conversation (``response`` a message list; ``prompt`` None, text or its leading messages),
    or text with ``apply_chat_template``: the chat template of the whole conversation as it renders it
    (end-of-turn tokens included), the response being the final assistant message."""
    if (apply_chat_template or isinstance(prompt, list)) and isinstance(response, str) and response:
        response = [{"role": "assistant", "content": response}]  # the template renders the turn's end
    if _messages(response):
        messages = (list(prompt) if isinstance(prompt, list) else []) + list(response)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}, *messages]
        if len(messages) < 2 or messages[-1].get("role") != "assistant":
            raise ValueError("a conversation must end with an assistant message (the response)")
        p = _ids(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True))
        full = _ids(tokenizer.apply_chat_template(messages, tokenize=True))
        if full[: len(p)] != p:
            raise ValueError("the chat template renders the prompt differently inside the conversation")
        ids = full  # the template's end-of-turn tokens are what the model must learn to emit ...
        if tokenizer.eos_token_id not in full[len(p) :]:  # ... and EOS, where the turn's end is not it
            ids = [*full, tokenizer.eos_token_id]
    else:
        if not isinstance(response, str) or not response:
            raise ValueError("the response must be non-empty text or a message list")
        if prompt is None:
            raise ValueError("a text response needs a prompt")
        p = encode_prompt(prompt, tokenizer, apply_chat_template=apply_chat_template)
        ids = p + tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    start = max(1, 0 if train_on_prompt else len(p))  # the first token has no prediction
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[start:] = True
    return Example(token_ids=torch.tensor(ids, dtype=torch.long), loss_mask=mask)


def _ids(out: Any) -> list[int]:
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "input_ids") else out)


def _rows(path: Path, flag: str) -> Iterator[tuple[_Source, dict]]:
    where, rows = read_rows(path, flag=flag)
    try:
        for number, row in rows:
            yield _Source(path, where, number), row
    except UnicodeDecodeError:
        raise ValueError(f"{path}, line {_first_undecodable_line(path)}: not UTF-8 text") from None


def _first_undecodable_line(path: Path) -> int:
    """The number of the first line of ``path`` that is not UTF-8 (0 when every line decodes)."""
    with Path(path).open("rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


def _get(row: dict, key: str, flag: str, src: _Source) -> Any:
    if key not in row:
        raise src.fail(f"no {key!r} key ({flag}); keys: {sorted(row)}")
    return row[key]


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_len: int
    max_samples: int | None


def _limits(data: ExampleData) -> Limits:
    return Limits(max_len=data.max_len, max_samples=data.max_samples)


def _keep(items: Iterable[tuple[E, int]], path: Path, flag: str, limits: Limits) -> list[E]:
    """``(item, its longest sequence)`` pairs: the first ``--data.max_samples`` items within
    ``--data.max_len`` (the longer ones are skipped and counted); an error if none is left. Reading
    stops at the cap. (KTO caps the rows it reads, before this filter: its partners need them all.)"""
    out: list[E] = []
    dropped = 0
    for item, length in items:
        if length > limits.max_len:
            dropped += 1
            continue
        out.append(item)
        if limits.max_samples and len(out) >= limits.max_samples:
            break
    if not out:
        more = f" ({dropped} longer than --data.max_len {limits.max_len})" if dropped else ""
        raise ValueError(f"{flag}: {str(path)!r} holds no usable examples{more}")
    if dropped:
        print(f"{path}: skipped {dropped} example(s) longer than --data.max_len {limits.max_len}")
    return out


def _row_images(
    row: dict, prompt: Any, data: ExampleData, src: _Source, encoder: ImageEncoder | None
) -> tuple:
    """A row's images, checked against its prompt (or conversation) and the model."""
    base = src.path if src.path.is_dir() else src.path.parent
    return prompt_row_images(
        row, data.image_key, prompt, base=base, where=src.text, model_takes_images=encoder is not None
    )


def load_sft(
    path: Path,
    tokenizer: Any,
    data: SFTData,
    *,
    flag: str = "--data.path",
    encoder: ImageEncoder | None = None,
) -> list[Example]:
    """SFT examples; ``data`` names the keys (``--data.*``). With ``encoder`` (a vision-language model's
    processor) rows may hold images (``--data.image_key``)."""
    prompt_key, response_key, messages_key = data.input_key, data.response_key, data.messages_key
    apply_chat_template, train_on_prompt = data.apply_chat_template, data.train_on_prompt

    def examples() -> Iterator[tuple[Example, int]]:
        for src, row in _rows(path, flag):
            try:
                if messages_key in row and response_key not in row:
                    prompt, response = None, row[messages_key]
                    if not _messages(response):
                        raise ValueError(f"{messages_key!r} must be a list of {{role, content}} messages")
                else:
                    prompt = _get(row, prompt_key, "--data.input_key", src)
                    response = _get(row, response_key, "--data.response_key", src)
                images = _row_images(row, response if prompt is None else prompt, data, src, encoder)
                if images and encoder is not None:
                    ex = Example(**encoder.example(prompt, response, images, train_on_prompt=train_on_prompt))
                else:
                    chat = apply_chat_template or prompt is None
                    ex = encode_example(
                        prompt, response, tokenizer, apply_chat_template=chat, train_on_prompt=train_on_prompt
                    )
            except ValueError as err:
                raise err if str(err).startswith(str(path)) else src.fail(str(err)) from None
            yield ex, ex.length

    return _keep(examples(), path, flag, _limits(data))


def load_pairs(
    path: Path,
    tokenizer: Any,
    data: PairData,
    *,
    flag: str = "--data.path",
    encoder: ImageEncoder | None = None,
) -> list[PreferencePair]:
    """Preference pairs; ``data`` names the keys (``--data.*``). With ``encoder`` (a vision-language
    model's processor) rows may hold images (``--data.image_key``), shared by both responses."""
    prompt_key, chosen_key, rejected_key = data.input_key, data.chosen_key, data.rejected_key
    apply_chat_template = data.apply_chat_template

    def pairs() -> Iterator[tuple[PreferencePair, int]]:
        for src, row in _rows(path, flag):
            chosen = _get(row, chosen_key, "--data.chosen_key", src)
            rejected = _get(row, rejected_key, "--data.rejected_key", src)
            prompt = row.get(prompt_key)
            if prompt is None and not _messages(chosen):
                raise src.fail(f"no {prompt_key!r} key (--data.input_key); keys: {sorted(row)}")
            try:
                images = _row_images(row, chosen if prompt is None else prompt, data, src, encoder)
                chosen_ex, rejected_ex = (
                    Example(**encoder.example(prompt, r, images))
                    if images and encoder is not None
                    else encode_example(prompt, r, tokenizer, apply_chat_template=apply_chat_template)
                    for r in (chosen, rejected)
                )
                pair = PreferencePair(chosen=chosen_ex, rejected=rejected_ex)
            except ValueError as err:
                raise src.fail(str(err)) from None
            yield pair, max(pair.chosen.length, pair.rejected.length)

    return _keep(pairs(), path, flag, _limits(data))


def load_kto(
    path: Path, tokenizer: Any, data: KTOData, *, seed: int = 0, flag: str = "--data.path"
) -> list[KTOExample]:
    """KTO examples, each with its mismatched partner (:func:`mismatched_partners`); ``data`` names the
    keys (``--data.*``)."""
    prompt_key, completion_key, label_key = data.input_key, data.completion_key, data.label_key
    apply_chat_template, limits = data.apply_chat_template, _limits(data)
    rows: list[tuple[Any, Any, bool]] = []
    for src, row in _rows(path, flag):
        prompt = _get(row, prompt_key, "--data.input_key", src)
        completion = _get(row, completion_key, "--data.completion_key", src)
        label = _get(row, label_key, "--data.label_key", src)
        if not isinstance(label, bool):
            raise src.fail(f"{label_key!r} must be true (desirable) or false, got {label!r}")
        try:
            encode_example(prompt, completion, tokenizer, apply_chat_template=apply_chat_template)
        except ValueError as err:
            raise src.fail(str(err)) from None
        rows.append((prompt, completion, label))
        if limits.max_samples and len(rows) >= limits.max_samples:
            break
    partners = mismatched_partners([json.dumps(p, sort_keys=True) for p, _, _ in rows], seed=seed)

    def examples() -> Iterator[tuple[KTOExample, int]]:
        for i, (prompt, completion, label) in enumerate(rows):
            other = rows[partners[i]][1]  # fixed per example, so the reference can be precomputed
            ex = encode_example(prompt, completion, tokenizer, apply_chat_template=apply_chat_template)
            mis = encode_example(prompt, other, tokenizer, apply_chat_template=apply_chat_template)
            yield KTOExample(example=ex, desirable=label, mismatched=mis), max(ex.length, mis.length)

    return _keep(examples(), path, flag, limits)


def mismatched_partners(prompts: Sequence[str], *, seed: int) -> list[int]:
    """For each example, another example whose prompt differs (its response makes the KTO reference
    point's sample ``(x_i, y_j)``): the next one in a seeded circular shuffle whose prompt is not
    ``x_i``; the next example when every prompt is the same. One pass backwards round the circle (O(n))."""
    n = len(prompts)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    if len(set(prompts)) <= 1:
        return [order[(k + 1) % n] for k in sorted(range(n), key=lambda k: order[k])]
    nearest: list[int | None] = [None] * n  # nearest[k]: first position after k with another prompt
    for k in reversed(range(2 * n)):  # twice round: positions near the end see the start
        pos, nxt = k % n, (k + 1) % n
        if prompts[order[nxt]] != prompts[order[pos]]:
            nearest[pos] = nxt
        elif nearest[nxt] is not None:
            nearest[pos] = nearest[nxt]
    partner = [0] * n
    for k, idx in enumerate(order):
        partner[idx] = order[nearest[k]]  # type: ignore[index]
    return partner


@dataclass(kw_only=True)
class ExampleSet(Generic[E]):
    """Examples served in an order shuffled by ``seed`` (a new order each epoch) from ``cursor``."""

    items: list[E]
    seed: int
    cursor: PromptCursor

    def next_batch(self, size: int) -> list[E]:
        picked: list[E] = []
        while len(picked) < size:
            order = seeded_order(len(self.items), seed=self.seed, epoch=self.cursor.epoch)
            take = order[self.cursor.index : self.cursor.index + size - len(picked)]
            picked += [self.items[i] for i in take]
            self.cursor.index += len(take)
            if self.cursor.index >= len(order):
                self.cursor = PromptCursor(epoch=self.cursor.epoch + 1, index=0)
        return picked


def split_heldout(items: Sequence[E], fraction: float, *, seed: int) -> tuple[list[E], list[E]]:
    """A seeded held-out split: ``(train, heldout)``, heldout at least one item when fraction > 0."""
    if fraction <= 0:
        return list(items), []
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    k = max(1, round(len(items) * fraction))
    if k >= len(items):
        raise ValueError(f"--eval.split {fraction}: leaves no training examples out of {len(items)}")
    held = set(order[:k])
    return [x for i, x in enumerate(items) if i not in held], [items[i] for i in sorted(held)]
