"""What the stages need of a learner group: small Protocols, so the stage functions run against the Ray
``LearnerGroup`` in a run and against a plain in-process fake in unit tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
from rlhf_learner import PolicyBatch, StepResult, ValueBatch

from rlhf_cli.runtime.learners.late_reference import LateReference, PendingScores
from rlhf_cli.runtime.learners.specs import GroupSpec, PolicyLossSettings, ValueLossSettings

__all__ = ["PolicyGroup", "ScoringGroup", "TeacherGroup", "ValueGroup"]

T = TypeVar("T")


class ScoringGroup(Protocol):
    """A group that scores sequences: per-token log-probs (actor, reference), values (critic) or one
    score per sequence (reward model)."""

    spec: GroupSpec

    def shards(self, items: Sequence[T]) -> list[list[T]]: ...

    def forward(
        self, sequences: Sequence[torch.Tensor], *, micro_batch_size: int, packing: bool
    ) -> list[torch.Tensor]: ...

    def submit_forward(
        self, sequences: Sequence[torch.Tensor], *, micro_batch_size: int, packing: bool
    ) -> Callable[[], list[torch.Tensor]]:
        """Start ``forward``; the returned call waits for its results."""
        ...

    def start_forward(
        self, sequences: Sequence[torch.Tensor], *, micro_batch_size: int, packing: bool
    ) -> PendingScores:
        """Start ``forward``, for another group's ranks to fetch its results."""
        ...


class TeacherGroup(ScoringGroup, Protocol):
    """A distillation teacher: scores, and its top k at chosen tokens (dense distillation)."""

    def submit_teacher_targets(
        self,
        sequences: Sequence[Any],
        masks: Sequence[torch.Tensor],
        *,
        micro_batch_size: int,
        top_k: int | None,
        vocab: int | None,
        token_logp: bool = False,
    ) -> Callable[[], list[Any]]:
        """Start each sequence's teacher targets at its ``masks`` tokens; the returned call waits for them."""
        ...


class PolicyGroup(ScoringGroup, Protocol):
    """The actor: scores, and takes policy updates."""

    def train_policy(
        self,
        per_rank: Sequence[list[PolicyBatch]],
        *,
        settings: PolicyLossSettings,
        reference: tuple[PendingScores, Sequence[LateReference]] | None = None,
    ) -> StepResult: ...


class ValueGroup(ScoringGroup, Protocol):
    """The critic: values, and value updates."""

    def train_value(
        self, per_rank: Sequence[list[ValueBatch]], *, settings: ValueLossSettings
    ) -> StepResult: ...
