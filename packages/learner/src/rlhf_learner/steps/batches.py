"""Typed micro-batches: one type per update step, checked when built.

Every batch is a set of token rows, right-padded (``attention_mask``) or packed (``position_ids``
restarting per sequence), plus the per-token (``[B, T]``) and per-row or per-pair fields its step reads.
Batches compare by identity (``eq=False``: tensors have no single truth value).
Per-token fields are aligned with ``input_ids``: column ``t`` describes token ``t`` (see ``Actor``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Self

import torch

__all__ = [
    "DPOBatch",
    "DistillBatch",
    "KTOBatch",
    "ModelRows",
    "PolicyBatch",
    "RewardBatch",
    "SFTBatch",
    "ValueBatch",
]


_NOT_PER_TOKEN = ("input_ids", "pixel_values", "image_grid_thw")


@dataclass(frozen=True, kw_only=True, eq=False)
class ModelRows:
    """Token rows as a model reads them. Subclasses add the fields of one step."""

    input_ids: torch.Tensor
    """``[B, T]`` token ids."""
    attention_mask: torch.Tensor | None = None
    """``[B, T]`` 1 on real tokens (right-padded rows)."""
    position_ids: torch.Tensor | None = None
    """``[B, T]`` positions restarting at 0 per sequence (packed rows)."""
    pixel_values: torch.Tensor | None = None
    """Vision-language models: the rows' images, as the model's processor flattens them (``[patches, dim]``,
    the images in the order their placeholder tokens appear, row by row)."""
    image_grid_thw: torch.Tensor | None = None
    """``[images, 3]``: each image's grid of patches (time, height, width), as the processor gives it."""
    mm_token_type_ids: torch.Tensor | None = None
    """``[B, T]`` 1 on the images' tokens (with ``pixel_values``): a placeholder token the policy sampled
    is text, as the engine read it."""

    per_row: ClassVar[tuple[str, ...]] = ()
    """Fields that hold one value per row, or per row group (checked by ``_check_rows``)."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{name}.{f.name}: expected a tensor, got {type(value).__name__}")
        if self.input_ids.dim() != 2:
            raise ValueError(f"{name}.input_ids: expected a [B, T] tensor, got {tuple(self.input_ids.shape)}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _NOT_PER_TOKEN or f.name in self.per_row or value is None:
                continue
            if tuple(value.shape) != tuple(self.input_ids.shape):
                raise ValueError(
                    f"{type(self).__name__}.{f.name}: shape {tuple(value.shape)}, "
                    f"input_ids has {tuple(self.input_ids.shape)}"
                )
        given = [
            self.pixel_values is not None,
            self.image_grid_thw is not None,
            self.mm_token_type_ids is not None,
        ]
        if any(given) and not all(given):
            raise ValueError(f"{name}.pixel_values, image_grid_thw and mm_token_type_ids: give all or none")
        self._check_rows()

    def _check_rows(self) -> None:
        """Per-row field checks of a subclass."""

    def _expect_rows(self, name: str, n: int) -> None:
        value = getattr(self, name)
        if value is not None and tuple(value.shape) != (n,):
            raise ValueError(f"{type(self).__name__}.{name}: shape {tuple(value.shape)}, expected ({n},)")

    def _paired_rows(self) -> int:
        """Half the row count (pairs: chosen then rejected; KTO: examples then mismatched rows). These
        steps read one score or sum per row, so rows hold one sequence each: padded, not packed."""
        if self.position_ids is not None:
            raise ValueError(
                f"{type(self).__name__}.position_ids: rows hold one sequence each (pad, do not pack)"
            )
        rows = self.input_ids.shape[0]
        if rows % 2:
            raise ValueError(f"{type(self).__name__}.input_ids: {rows} rows, expected an even count")
        return rows // 2

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of a model call besides ``input_ids`` (the masks and images that are set)."""
        out = {
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "mm_token_type_ids": self.mm_token_type_ids,
        }
        return {k: v for k, v in out.items() if v is not None}

    def to(self, device: torch.device | str) -> Self:
        """A copy with every tensor on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


@dataclass(frozen=True, kw_only=True, eq=False)
class PolicyBatch(ModelRows):
    """A micro-batch of :func:`~rlhf_learner.steps.ppo_actor_step`."""

    action_mask: torch.Tensor
    """True on the tokens the policy sampled (trained on)."""
    advantages: torch.Tensor
    old_logp: torch.Tensor | None = None
    """Log-probs under the policy before this update. None when the update is exactly on-policy (the
    batch's only optimizer step): the current log-probs, detached, stand in (ratio 1, same gradient)."""
    ref_logp: torch.Tensor | None = None
    """Reference log-probs (for a KL loss)."""
    rollout_logp: torch.Tensor | None = None
    """The sampling engine's log-probs (for importance-sampling correction)."""
    teacher_logp: torch.Tensor | None = None
    """Dense on-policy distillation: ``[N, K]`` a teacher's log-probs of ``teacher_ids`` where each of the
    ``N`` action tokens (row-major) was predicted (its top k, or the whole vocabulary)."""
    teacher_ids: torch.Tensor | None = None
    """``[N, K]`` the token ids they are of."""

    per_row: ClassVar[tuple[str, ...]] = ("teacher_logp", "teacher_ids")

    def _check_rows(self) -> None:
        if (self.teacher_logp is None) != (self.teacher_ids is None):
            raise ValueError("PolicyBatch.teacher_logp and teacher_ids: give both or neither")
        if self.teacher_logp is not None:
            _check_targets(self, self.action_mask)


@dataclass(frozen=True, kw_only=True, eq=False)
class ValueBatch(ModelRows):
    """A micro-batch of :func:`~rlhf_learner.steps.critic_step`."""

    action_mask: torch.Tensor
    old_values: torch.Tensor
    """The critic's values before this update (for value clipping)."""
    returns: torch.Tensor


@dataclass(frozen=True, kw_only=True, eq=False)
class SFTBatch(ModelRows):
    """A micro-batch of :func:`~rlhf_learner.steps.sft_step`."""

    loss_mask: torch.Tensor
    """True on the target tokens."""


@dataclass(frozen=True, kw_only=True, eq=False)
class RewardBatch(ModelRows):
    """A micro-batch of :func:`~rlhf_learner.steps.reward_model_step`: ``2P`` padded rows, the ``P``
    chosen sequences then the ``P`` rejected ones."""

    margin: torch.Tensor | None = None
    """``[P]`` optional margins of the pairs."""

    per_row: ClassVar[tuple[str, ...]] = ("margin",)

    def _check_rows(self) -> None:
        self._expect_rows("margin", self._paired_rows())


@dataclass(frozen=True, kw_only=True, eq=False)
class DPOBatch(ModelRows):
    """A micro-batch of :func:`~rlhf_learner.steps.dpo_step`: ``2P`` padded rows, chosen then rejected."""

    loss_mask: torch.Tensor
    """True on the response tokens."""
    ref_logp: torch.Tensor
    """``[2P]`` the reference model's summed response log-probs of every row."""

    per_row: ClassVar[tuple[str, ...]] = ("ref_logp",)

    def _check_rows(self) -> None:
        self._expect_rows("ref_logp", 2 * self._paired_rows())


@dataclass(frozen=True, kw_only=True, eq=False)
class KTOBatch(ModelRows):
    """A micro-batch of :func:`~rlhf_learner.steps.kto_step`: ``N`` example rows, then ``N`` mismatched
    rows (prompt ``i`` with another example's response) for the KL reference point."""

    loss_mask: torch.Tensor
    """True on the response tokens."""
    ref_logp: torch.Tensor
    """``[2N]`` the reference model's summed response log-probs of every row."""
    desirable: torch.Tensor
    """``[N]`` bool: whether each example is desirable."""

    per_row: ClassVar[tuple[str, ...]] = ("ref_logp", "desirable")

    def _check_rows(self) -> None:
        n = self._paired_rows()
        self._expect_rows("ref_logp", 2 * n)
        self._expect_rows("desirable", n)


@dataclass(frozen=True, kw_only=True, eq=False)
class DistillBatch(ModelRows):
    """A micro-batch of :func:`~rlhf_learner.steps.distill_step`: rows (padded or packed) and the teacher's
    next-token distribution at each of the ``N`` target tokens (``loss_mask``, in row-major order), over
    ``K`` tokens: its top k, or the whole vocabulary."""

    loss_mask: torch.Tensor
    """True on the target tokens."""
    teacher_logp: torch.Tensor
    """``[N, K]`` the teacher's log-probs of ``teacher_ids`` where each target token was predicted."""
    teacher_ids: torch.Tensor
    """``[N, K]`` the token ids they are of."""

    per_row: ClassVar[tuple[str, ...]] = ("teacher_logp", "teacher_ids")

    def _check_rows(self) -> None:
        _check_targets(self, self.loss_mask)


def _check_targets(batch: ModelRows, mask: torch.Tensor) -> None:
    """A batch's ``teacher_logp`` / ``teacher_ids``: ``[N, K]`` each, one row per ``mask`` token."""
    n = int(mask.bool().sum())
    lp, ids = batch.teacher_logp, batch.teacher_ids  # type: ignore[attr-defined]
    if lp.dim() != 2 or lp.shape[0] != n or tuple(ids.shape) != tuple(lp.shape):
        raise ValueError(
            f"{type(batch).__name__}.teacher_logp / teacher_ids: shapes {tuple(lp.shape)} / "
            f"{tuple(ids.shape)}, expected ({n}, K) each (one row per target token)"
        )
