"""Reference log-probs bound late: the reference group's forward of a step's samples runs while the actor's
update starts, and each actor rank fetches the results itself when its first loss needs them.

The driver starts the reference forward and keeps its ranks' result references (:class:`PendingScores`);
each actor rank gets, with its micro-batches, a :class:`LateReference`: those references and where each of
its micro-batches' samples sit in its rows, and fetches the shards it needs. Nothing of the reference's
output passes through the driver.
"""

from __future__ import annotations

import bisect
import itertools
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


def ref_logp_of(
    late: LateReference, shapes: Sequence[torch.Size], fetched: dict[Any, list[torch.Tensor]]
) -> Callable[[int], torch.Tensor]:
    """``ref_logp_of(i)`` for ``rlhf_learner.ppo_actor_step``: micro-batch ``i``'s reference log-probs as a
    ``shapes[i]`` float32 tensor. The results of the reference's shards these micro-batches need are
    fetched at the first call (within ``late.timeout_s``) into ``fetched`` (reference -> results), which
    a rank keeps across the optimizer steps of one rollout batch."""
    import ray

    starts = list(itertools.accumulate(late.lengths, initial=0))
    part_of = {s: bisect.bisect_right(starts, s) - 1 for mb in late.placements for s, *_ in mb}

    def of(i: int) -> torch.Tensor:
        missing = sorted({p for p in part_of.values() if late.parts[p] not in fetched})
        if missing:
            values = ray.get([late.parts[p] for p in missing], timeout=late.timeout_s)
            fetched.update(zip((late.parts[p] for p in missing), values, strict=True))
        out = torch.zeros(shapes[i], dtype=torch.float32)
        for sample, row, start, length in late.placements[i]:
            p = part_of[sample]
            out[row, start : start + length] = fetched[late.parts[p]][sample - starts[p]][:length]
        return out

    return of
