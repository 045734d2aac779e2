"""What DPO and KTO share: reference log-probs of their examples, from the reference group per step or
precomputed once (``--ref.precompute``), after which the group stops."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Generic, TypeVar

import torch
from rlhf_cli.data.examples import Example, KTOExample, PreferencePair
from rlhf_cli.runtime.learners.group import LearnerGroup

__all__ = ["SCORING_CHUNK", "ReferenceObjective", "sequence_logps", "with_reference"]


SCORING_CHUNK = 1024
"""Sequences per call when a group scores many (each call has the Ray timeout; progress is printed)."""


def sequence_logps(group: LearnerGroup, examples: Sequence[Example], *, micro_batch_size: int) -> list[float]:
    """Summed log-probs of each example's loss-mask tokens under ``group`` (a policy or reference),
    from padded rows as the training steps see them, in chunks of :data:`SCORING_CHUNK`; the ranks
    return one float per sequence."""
    out: list[float] = []
    for lo in range(0, len(examples), SCORING_CHUNK):
        chunk = examples[lo : lo + SCORING_CHUNK]
        out += group.sequence_logps(
            [e.scored for e in chunk], [e.loss_mask for e in chunk], micro_batch_size=micro_batch_size
        )
        if len(examples) > SCORING_CHUNK:
            print(f"{group.spec.role}: scored {len(out)}/{len(examples)} sequences", file=sys.stderr)
    return out


P = TypeVar("P", PreferencePair, KTOExample)


def with_reference(items: list[P], ref: LearnerGroup | None, *, micro_batch_size: int) -> list[P]:
    """``items`` with ``ref_logp`` filled in by the reference group (items that have it are kept)."""
    todo = [i for i, x in enumerate(items) if x.ref_logp is None]
    if not todo:
        return items
    if ref is None:
        raise RuntimeError("reference log-probs are missing and the reference group was stopped")
    seqs = [s for i in todo for s in items[i].sequences]
    logps = sequence_logps(ref, seqs, micro_batch_size=micro_batch_size)
    out = list(items)
    for k, i in enumerate(todo):
        out[i] = replace(items[i], ref_logp=(logps[2 * k], logps[2 * k + 1]))
    return out


class ReferenceObjective(Generic[P]):
    """What DPO and KTO share: reference log-probs attached to their examples (computed by the
    reference group per step, or for every example once with ``--ref.precompute``)."""

    cfg: Any
    groups: Any

    def _ref(self, items: list[P]) -> list[P]:
        return with_reference(items, self.groups.ref, micro_batch_size=self.cfg.train.micro_batch_size)

    def prepare(self, train: list[P], evals: list[P]) -> tuple[list[P], list[P]]:
        """The evaluation examples are scored by the reference once, here (every evaluation reuses
        them); the training examples too with ``--ref.precompute``, after which the group stops."""
        evals = self._ref(evals)
        if not self.cfg.ref.precompute:
            return train, evals
        train = self._ref(train)
        self.groups.stop_ref()
        return train, evals

    def _with_ref(
        self, per_rank: Sequence[Sequence[Sequence[P]]]
    ) -> list[list[tuple[list[P], torch.Tensor]]]:
        """The step's micro-batches with their reference log-probs as ``[2n]`` tensors (first
        sequences, then second: chosen then rejected, or examples then mismatched)."""
        flat = iter(self._ref([x for mbs in per_rank for mb in mbs for x in mb]))
        out = []
        for mbs in per_rank:
            out.append([])
            for mb in mbs:
                items = [next(flat) for _ in mb]
                ref = torch.tensor([x.ref_logp[0] for x in items] + [x.ref_logp[1] for x in items])
                out[-1].append((items, ref))
        return out

    def _logps(self, items: list[P]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Policy and reference summed log-probs of each item's two sequences:
        ``(policy first, policy second, reference first, reference second)``, each ``[n]``."""
        items = self._ref(items)
        seqs = [x.sequences[0] for x in items] + [x.sequences[1] for x in items]
        logp = torch.tensor(
            sequence_logps(self.groups.model, seqs, micro_batch_size=self.cfg.train.micro_batch_size)
        )
        ref = torch.tensor([x.ref_logp for x in items])
        n = len(items)
        return logp[:n], logp[n:], ref[:, 0], ref[:, 1]

    def finish(self, train: list[P]) -> None:
        pass
