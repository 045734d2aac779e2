"""Offline knowledge distillation: the teacher's next-token distributions (top k or whole) and the step
that pulls the student's towards them. The divergence comes in as a function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhf_learner.steps._window import StepResult, TrainEngine, WindowCounts, masked_counts, run_window
from rlhf_learner.steps.batches import DistillBatch, ModelRows
from rlhf_learner.steps.losses import DivergenceFn

__all__ = ["distill_divergences", "distill_step", "student_logp_at", "teacher_distributions", "top_tokens"]


@torch.no_grad()
def teacher_distributions(
    model: Any, rows: ModelRows, loss_mask: torch.Tensor, *, top_k: int | None, vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution that predicted each ``loss_mask`` token (row-major), under ``model`` (an
    ``Actor``): ``(logp, ids)``, each ``[N, K]``, the ``top_k`` most likely tokens (None: all of them, in
    id order). ``vocab``: only the first ``vocab`` logits count (the student's; a teacher's embedding
    may be padded beyond it), renormalised over them."""
    rows = rows.to(next(model.parameters()).device)
    picked = model(rows.input_ids, **rows.model_inputs(), vocab_logp_at=loss_mask).vocab_logp
    return top_tokens(picked, top_k=top_k, vocab=vocab)


def top_tokens(
    picked: torch.Tensor, *, top_k: int | None, vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`teacher_distributions` from a forward's ``[N, V]`` ``vocab_logp`` (the distributions at the
    target tokens): ``(logp, ids)``, each ``[N, K]``."""
    if vocab is not None and vocab < picked.shape[-1]:
        picked = torch.log_softmax(picked[:, :vocab], dim=-1)
    if top_k is None:
        ids = torch.arange(picked.shape[-1], device=picked.device).expand_as(picked)
        return picked, ids
    if top_k > picked.shape[-1]:
        raise ValueError(f"top_k: {top_k} is more than the vocabulary's {picked.shape[-1]} tokens")
    top = picked.topk(top_k, dim=-1)
    return top.values, top.indices


def distill_divergences(
    model: Any, batch: DistillBatch, *, divergence_fn: DivergenceFn
) -> tuple[torch.Tensor, Any]:
    """``[N]`` the divergence at each target token of ``batch`` (row-major) under ``model`` (an ``Actor``,
    or an engine wrapping one; with gradients unless the caller turns them off): the student's log-probs
    of the teacher's K tokens, gathered from its whole distribution, against the teacher's. Also returns
    the model's output."""
    out = model(batch.input_ids, **batch.model_inputs(), vocab_logp_at=batch.loss_mask)
    student = student_logp_at(out.vocab_logp, batch.teacher_ids)
    return divergence_fn(student, batch.teacher_logp.to(student.dtype)), out


def student_logp_at(vocab_logp: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` the student's log-probs of the teacher's ``[N, K]`` tokens, from its ``[N, V]``
    distributions at the same target tokens; a token outside its vocabulary is refused."""
    vocab = vocab_logp.shape[-1]
    if teacher_ids.numel() and int(teacher_ids.max()) >= vocab:
        raise ValueError(
            f"teacher_ids: token {int(teacher_ids.max())} is outside the student's {vocab}-token vocabulary"
        )
    if vocab_logp.shape[0] != teacher_ids.shape[0]:
        raise ValueError(
            f"teacher_ids: targets for {teacher_ids.shape[0]} tokens, the student's distributions are at "
            f"{vocab_logp.shape[0]}"
        )
    return vocab_logp.gather(-1, teacher_ids.long().to(vocab_logp.device))


def distill_step(
    engine: TrainEngine, micro_batches: Sequence[DistillBatch], *, divergence_fn: DivergenceFn
) -> StepResult:
    """Knowledge distillation. ``engine`` wraps an ``Actor``; each micro-batch is a
    :class:`~rlhf_learner.steps.DistillBatch`. The loss is the token mean over the
    step of :func:`distill_divergences`, ``divergence_fn(student_logp, teacher_logp)`` (e.g. rlhf-algos' ``token_divergence`` over
    ``with_rest`` log-probs). Metrics: ``divergence`` (the same mean) and ``nll`` of the targets."""

    def compute(mb: DistillBatch, c: WindowCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        div, out = distill_divergences(engine, mb, divergence_fn=divergence_fn)
        mask = mb.loss_mask.bool()
        loss = div.sum() / c.global_tokens * c.dp_size
        nll = -(out.logp.detach().float() * mask).sum()
        return loss, {"divergence": div.detach().sum(), "nll": nll}

    return run_window(
        engine,
        micro_batches,
        batch_type=DistillBatch,
        count=lambda mb: masked_counts(mb.loss_mask),
        compute=compute,
        token_metrics=("divergence", "nll"),
    )
