"""SFT, reward-model, DPO and KTO update steps. Loss math comes in as functions."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlhf_learner.steps._window import (
    StepResult,
    TrainEngine,
    WindowCounts,
    all_gather_rows,
    loss_tensor,
    masked_counts,
    run_window,
)
from rlhf_learner.steps.batches import DPOBatch, KTOBatch, ModelRows, RewardBatch, SFTBatch
from rlhf_learner.steps.losses import DPOLossFn, KLBaselineFn, KTOLossFn, PairLossFn, SFTLossFn

__all__ = ["dpo_step", "kto_step", "reward_model_step", "sequence_logp", "sft_step"]


def sequence_logp(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` summed log-prob of the masked tokens of each row."""
    return (logp * mask.to(logp.dtype)).sum(-1)


def _row_pairs(mb: ModelRows) -> tuple[float, float]:
    """count: one sequence per pair of rows (a preference pair, or a KTO example and its mismatch)."""
    pairs = mb.input_ids.shape[0] // 2
    return float(pairs), float(pairs)


def _per_seq_mean(losses: torch.Tensor, c: WindowCounts) -> torch.Tensor:
    return losses.sum() / c.global_seqs * c.dp_size


def sft_step(engine: TrainEngine, micro_batches: Sequence[SFTBatch], *, sft_loss_fn: SFTLossFn) -> StepResult:
    """Supervised fine-tuning. ``engine`` wraps an ``Actor``; each micro-batch is an
    :class:`~rlhf_learner.steps.SFTBatch` (loss on ``loss_mask`` tokens). Loss:
    ``sft_loss_fn(logp, loss_mask, global_tokens=, global_seqs=, dp_size=)`` (e.g. ``rlhf_algos.sft_loss``)."""

    def compute(mb: SFTBatch, c: WindowCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = engine(mb.input_ids, **mb.model_inputs())
        loss = sft_loss_fn(
            out.logp,
            mb.loss_mask,
            global_tokens=c.global_tokens,
            global_seqs=c.global_seqs,
            dp_size=c.dp_size,
        )
        return loss, {"nll": -(out.logp.detach() * mb.loss_mask.to(out.logp.dtype)).sum()}

    return run_window(
        engine,
        micro_batches,
        batch_type=SFTBatch,
        count=lambda mb: masked_counts(mb.loss_mask),
        compute=compute,
        token_metrics=("nll",),
    )


def reward_model_step(
    engine: TrainEngine,
    micro_batches: Sequence[RewardBatch],
    *,
    pair_loss_fn: PairLossFn,
) -> StepResult:
    """Pairwise reward-model training. ``engine`` wraps a ``RewardModel``; each micro-batch is a
    :class:`~rlhf_learner.steps.RewardBatch` of ``2P`` rows, chosen ``[:P]`` then rejected ``[P:]``,
    with optional ``margin`` ``[P]``. Loss: mean over all pairs of the step of ``pair_loss_fn(chosen, rejected[, margin=])``
    (e.g. ``rlhf_algos.pairwise_rm_loss``)."""

    def compute(mb: RewardBatch, c: WindowCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        scores = engine(mb.input_ids, **mb.model_inputs(), normalize=False)
        p = scores.shape[0] // 2
        kw = {"margin": mb.margin} if mb.margin is not None else {}
        losses = pair_loss_fn(scores[:p], scores[p:], **kw)
        acc = (scores[:p] > scores[p:]).to(losses.dtype)
        return _per_seq_mean(losses, c), {
            "accuracy": acc.sum(),
            "margin": (scores[:p] - scores[p:]).detach().sum(),
        }

    return run_window(engine, micro_batches, batch_type=RewardBatch, count=_row_pairs, compute=compute)


def dpo_step(
    engine: TrainEngine,
    micro_batches: Sequence[DPOBatch],
    *,
    dpo_loss_fn: DPOLossFn,
    nll_coef: float = 0.0,
) -> StepResult:
    """Direct preference optimisation. ``engine`` wraps an ``Actor``; each micro-batch is a
    :class:`~rlhf_learner.steps.DPOBatch` of ``2P`` rows, chosen then rejected, whose ``ref_logp``
    ``[2P]`` holds the reference model's summed response log-probs (compute them beforehand with a
    frozen reference, e.g. :func:`rlhf_learner.steps.reference_sequence_logp`).
    Loss: mean over pairs of ``dpo_loss_fn(chosen, rejected, ref_chosen, ref_rejected)`` (a tensor or
    a result with ``.loss``, e.g. ``partial(rlhf_algos.dpo_loss, beta=0.1)``), plus ``nll_coef`` times
    the chosen responses' per-token NLL (RPO-style regulariser)."""

    def compute(mb: DPOBatch, c: WindowCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = engine(mb.input_ids, **mb.model_inputs())
        seq = sequence_logp(out.logp, mb.loss_mask)
        p = seq.shape[0] // 2
        ref = mb.ref_logp
        res = dpo_loss_fn(seq[:p], seq[p:], ref[:p], ref[p:])
        loss = _per_seq_mean(loss_tensor(res), c)
        if nll_coef:
            n = mb.loss_mask[:p].sum(-1).clamp(min=1)
            loss = loss + nll_coef * _per_seq_mean(-seq[:p] / n, c)
        margin = (seq[:p] - ref[:p]) - (seq[p:] - ref[p:])
        return loss, {"accuracy": (margin > 0).float().sum(), "logit_margin": margin.detach().sum()}

    return run_window(engine, micro_batches, batch_type=DPOBatch, count=_row_pairs, compute=compute)


def kto_step(
    engine: TrainEngine,
    micro_batches: Sequence[KTOBatch],
    *,
    kto_loss_fn: KTOLossFn,
    kl_baseline_fn: KLBaselineFn,
) -> StepResult:
    """Kahneman-Tversky optimisation. ``engine`` wraps an ``Actor``; each micro-batch is a
    :class:`~rlhf_learner.steps.KTOBatch`: ``N`` example rows followed by ``N`` mismatched rows
    (prompt i with another example's response) for the KL reference point, ``ref_logp`` ``[2N]``
    (reference summed log-probs of all rows) and ``desirable`` ``[N]``. The reference point is
    ``kl_baseline_fn(policy_kl_logp, ref_kl_logp)`` over the mismatched rows of this micro-batch on
    every data-parallel rank (all-gathered, detached; as TRL and OpenRLHF estimate it), so it does not
    depend on how the batch is split over ranks. (Ranks of a sequence-parallel group hold the same
    rows, so each row appears once per such rank: harmless for a mean such as rlhf-algos'
    ``kto_kl_baseline``.) Loss: mean over examples of
    ``kto_loss_fn(policy_logp, ref_logp, desirable, kl_baseline)`` (e.g. ``partial(rlhf_algos.kto_loss, beta=0.1)``)."""

    def compute(mb: KTOBatch, c: WindowCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = engine(mb.input_ids, **mb.model_inputs())
        seq = sequence_logp(out.logp, mb.loss_mask)
        n = seq.shape[0] // 2
        ref = mb.ref_logp
        kl_rows = all_gather_rows(torch.stack([seq[n:].float(), ref[n:].float()], dim=-1), engine)
        z0 = kl_baseline_fn(kl_rows[:, 0], kl_rows[:, 1])
        losses = kto_loss_fn(seq[:n], ref[:n], mb.desirable, z0)
        return _per_seq_mean(losses, c), {"kl_baseline": z0.detach().expand(n).sum()}

    return run_window(engine, micro_batches, batch_type=KTOBatch, count=_row_pairs, compute=compute)
