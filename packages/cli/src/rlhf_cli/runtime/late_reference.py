"""Reference log-probs bound late: the reference group's forward of a step's samples runs while the actor's
update starts, and each actor rank fetches the results itself when its first loss needs them.

The driver starts the reference forward and keeps its ranks' result references (:class:`PendingScores`);
each actor rank gets, with its micro-batches, a :class:`LateReference`: those references and where each of
its micro-batches' samples sit in its rows. Nothing of the reference's output passes through the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LateReference", "PendingScores", "Placement", "ref_logp_of"]

Placement = tuple[int, int, int, int]
"""``(sample, row, start, length)``: the sample's index in the step's batch and where its tokens sit in a
micro-batch's rows."""


@dataclass(frozen=True, kw_only=True)
class PendingScores:
    """A group's per-sequence forward, started and not waited for: one Ray reference per data shard (its
    result: a list of per-sequence tensors, the first ``lengths[i]`` of which are real; the rest pad the
    shards to equal length)."""

    parts: list[Any]
    lengths: list[int]
    all_refs: list[Any]
    """Every rank's call (those of a sequence- or tensor-parallel block return the same results)."""

    timeout_s: float
    """How long a rank may wait for the results (the scoring group's timeout)."""

    def for_rank(self, placements: list[list[Placement]]) -> LateReference:
        """What one rank of the updating group needs: ``placements`` per micro-batch of its own."""
        return LateReference(
            parts=self.parts, lengths=self.lengths, placements=placements, timeout_s=self.timeout_s
        )


@dataclass(frozen=True, kw_only=True)
class LateReference:
    """What one actor rank needs to fetch its micro-batches' reference log-probs (a task argument)."""

    parts: list[Any]
    lengths: list[int]
    placements: list[list[Placement]]
    """Per micro-batch of the rank, its samples' placements."""
    timeout_s: float


def ref_logp_of(late: LateReference, shapes: Sequence[torch.Size]) -> Callable[[int], torch.Tensor]:
    """``ref_logp_of(i)`` for ``rlhf_learner.ppo_actor_step``: micro-batch ``i``'s reference log-probs as a
    ``shapes[i]`` float32 tensor, from the reference's results (fetched at the first call, within
    ``late.timeout_s``)."""
    import ray

    fetched: list[torch.Tensor] = []

    def of(i: int) -> torch.Tensor:
        if not fetched:
            parts = ray.get(late.parts, timeout=late.timeout_s)
            fetched.extend(x for part, n in zip(parts, late.lengths, strict=True) for x in part[:n])
        out = torch.zeros(shapes[i], dtype=torch.float32)
        for sample, row, start, length in late.placements[i]:
            out[row, start : start + length] = fetched[sample][:length]
        return out

    return of
