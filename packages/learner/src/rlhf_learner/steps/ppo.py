"""PPO actor and critic update steps. Loss math comes in as functions (e.g. from rlhf-algos)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_learner.steps._window import (
    StepResult,
    TrainEngine,
    WindowCounts,
    loss_tensor,
    masked_counts,
    run_window,
)
from rlhf_learner.steps.batches import PolicyBatch, ValueBatch
from rlhf_learner.steps.distill import student_logp_at
from rlhf_learner.steps.losses import (
    AggregateFn,
    DivergenceFn,
    ISWeightsFn,
    KLLossFn,
    PolicyLossFn,
    ValueLossFn,
)

__all__ = ["critic_step", "ppo_actor_step"]


def ppo_actor_step(
    engine: TrainEngine,
    micro_batches: Sequence[PolicyBatch],
    *,
    policy_loss_fn: PolicyLossFn,
    aggregate_fn: AggregateFn,
    kl_loss_fn: KLLossFn | None = None,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    is_weights_fn: ISWeightsFn | None = None,
    aux_loss_coef: float = 0.0,
    ref_logp_of: Callable[[int], torch.Tensor] | None = None,
    distill_fn: DivergenceFn | None = None,
    distill_coef: float = 0.0,
) -> StepResult:
    """One PPO policy update over a gradient-accumulation window.

    ``engine`` wraps an :class:`~rlhf_learner.models.Actor`. Each micro-batch is a
    :class:`~rlhf_learner.steps.PolicyBatch`, with ``ref_logp`` when ``kl_loss_fn`` is given and
    ``rollout_logp`` when ``is_weights_fn`` is. ``ref_logp_of(i)``: micro-batch ``i``'s reference
    log-probs (laid out as its ``input_ids``) for micro-batches without ``ref_logp``, asked for once its
    forward has run, when its loss needs them: a reference forward elsewhere can still be running while
    this one does.

    Per token: ``policy_loss_fn(logp, old_logp, advantages, mask, **kw)`` (a tensor or a result with
    ``.loss``; ``kw`` has ``is_weights`` = ``is_weights_fn(old_logp, rollout_logp, mask)`` when set
    and ``entropy`` / ``entropy_coef`` when ``entropy_coef != 0``) ``+ kl_coef * kl_loss_fn(logp,
    ref_logp)``; reduced by ``aggregate_fn`` with the window's global counts. MoE models add
    ``aux_loss_coef * router_aux_loss`` (averaged over the window). A micro-batch without ``old_logp``
    is exactly on-policy: the current log-probs, detached, stand in. With ``rollout_logp`` the metrics
    hold ``logp_mismatch`` (mean) and ``logp_mismatch_max`` of ``|old_logp - rollout_logp|``.

    Dense on-policy distillation: with ``distill_fn`` (e.g. rlhf-algos' ``token_divergence``) each action
    token's loss adds ``distill_coef * distill_fn(student_logp, teacher_logp)`` over the micro-batch's
    ``teacher_ids`` (the student's gathered from its whole distribution); metric ``distill``: its mean.
    """
    fns = _ActorLoss(
        policy_loss_fn=policy_loss_fn,
        aggregate_fn=aggregate_fn,
        kl_loss_fn=kl_loss_fn,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        is_weights_fn=is_weights_fn,
        aux_loss_coef=aux_loss_coef,
        gas=len(micro_batches),
        ref_logp_of=ref_logp_of,
        distill_fn=distill_fn,
        distill_coef=distill_coef,
    )
    _check_policy_batches(micro_batches, fns)
    position = iter(range(len(micro_batches)))  # run_window computes the micro-batches once, in order
    return run_window(
        engine,
        micro_batches,
        batch_type=PolicyBatch,
        count=lambda mb: masked_counts(mb.action_mask),
        compute=lambda mb, c: _actor_micro_loss(engine, fns, mb, c, next(position)),
        token_metrics=("policy_loss", "clip_frac", "kl", "entropy", "logp_mismatch", "distill"),
    )


@dataclass(frozen=True, kw_only=True)
class _ActorLoss:
    """The loss functions and coefficients of one :func:`ppo_actor_step` call."""

    policy_loss_fn: PolicyLossFn
    aggregate_fn: AggregateFn
    kl_loss_fn: KLLossFn | None
    kl_coef: float
    entropy_coef: float
    is_weights_fn: ISWeightsFn | None
    aux_loss_coef: float
    gas: int
    """Micro-batches in the window (the router auxiliary loss is averaged over them)."""
    ref_logp_of: Callable[[int], torch.Tensor] | None = None
    distill_fn: DivergenceFn | None = None
    distill_coef: float = 0.0


def _check_policy_batches(micro_batches: Sequence[PolicyBatch], fns: _ActorLoss) -> None:
    """Raise when a micro-batch lacks the log-probs the given KL, IS-weight or distillation function needs."""
    if fns.kl_coef and fns.kl_loss_fn is None:
        raise ValueError("kl_coef: set, but no kl_loss_fn was given")
    for i, mb in enumerate(micro_batches):
        if not isinstance(mb, PolicyBatch):
            continue  # run_window names the wrong type
        if fns.distill_fn is not None and mb.teacher_ids is None:
            raise ValueError(f"micro_batches[{i}].teacher_logp / teacher_ids: needed by distill_fn, not set")
        if fns.kl_loss_fn is not None and mb.ref_logp is None and fns.ref_logp_of is None:
            raise ValueError(f"micro_batches[{i}].ref_logp: needed by kl_loss_fn, not set (nor ref_logp_of)")
        if fns.is_weights_fn is not None and mb.rollout_logp is None:
            raise ValueError(f"micro_batches[{i}].rollout_logp: needed by is_weights_fn, not set")


def _actor_micro_loss(
    engine: TrainEngine, fns: _ActorLoss, mb: PolicyBatch, c: WindowCounts, i: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's PPO actor loss (normalised by the window's counts ``c``) and metric sums."""
    mask = mb.action_mask
    out = engine(
        mb.input_ids,
        **mb.model_inputs(),
        return_entropy=fns.entropy_coef != 0.0,
        return_aux_loss=fns.aux_loss_coef != 0.0,
        vocab_logp_at=mask if fns.distill_fn is not None else None,
    )
    old = mb.old_logp if mb.old_logp is not None else out.logp.detach()
    kw: dict[str, Any] = {}
    if fns.is_weights_fn is not None:
        kw["is_weights"] = fns.is_weights_fn(old, mb.rollout_logp, mask)
    if fns.entropy_coef:
        kw["entropy"] = out.entropy
        kw["entropy_coef"] = fns.entropy_coef
    res = fns.policy_loss_fn(out.logp, old, mb.advantages, mask, **kw)
    per_token = loss_tensor(res)
    mf = mask.to(per_token.dtype)
    metrics = {"policy_loss": (per_token * mf).sum()}
    if mb.rollout_logp is not None:  # the engine's log-probs against this update's old policy
        gap = (old - mb.rollout_logp).abs() * mf
        metrics |= {"logp_mismatch": gap.sum(), "logp_mismatch_max": gap.max()}
    if getattr(res, "clipped", None) is not None:
        metrics["clip_frac"] = (res.clipped & mask.bool()).sum().to(per_token.dtype)
    if fns.kl_loss_fn is not None:
        ref = mb.ref_logp
        if ref is None:
            assert fns.ref_logp_of is not None  # (checked before the window)
            ref = fns.ref_logp_of(i).to(device=out.logp.device)
            if ref.shape != out.logp.shape:
                raise ValueError(
                    f"ref_logp_of({i}): shape {tuple(ref.shape)}, the micro-batch's is {tuple(out.logp.shape)}"
                )
        kl = fns.kl_loss_fn(out.logp, ref) * mf
        metrics["kl"] = kl.sum()
        if fns.kl_coef:
            per_token = per_token + fns.kl_coef * kl
    if out.entropy is not None:
        metrics["entropy"] = (out.entropy * mf).sum()
    if fns.distill_fn is not None:
        div = _distill_divergence(fns.distill_fn, mb, out.vocab_logp)
        metrics["distill"] = div.detach().sum()
        per_token = per_token + fns.distill_coef * div
    loss = fns.aggregate_fn(
        per_token, mask, global_tokens=c.global_tokens, global_seqs=c.global_seqs, dp_size=c.dp_size
    )
    if fns.aux_loss_coef:
        if out.aux_loss is None:
            raise ValueError("aux_loss_coef: the model returned no router auxiliary loss")
        loss = loss + fns.aux_loss_coef * out.aux_loss / fns.gas
    return loss, metrics


def _distill_divergence(fn: DivergenceFn, mb: PolicyBatch, vocab_logp: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` the divergence ``fn`` of the student's distribution from the teacher's at each action
    token (0 elsewhere), the student's log-probs (``vocab_logp``: ``[N, V]`` at the action tokens)
    gathered at the teacher's tokens."""
    assert mb.teacher_logp is not None and mb.teacher_ids is not None  # (checked before the window)
    mask = mb.action_mask.bool()
    student = student_logp_at(vocab_logp, mb.teacher_ids)
    out = torch.zeros(mask.shape, dtype=student.dtype, device=student.device)
    out[mask] = fn(student, mb.teacher_logp.to(student.dtype))
    return out


def critic_step(
    engine: TrainEngine,
    micro_batches: Sequence[ValueBatch],
    *,
    value_loss_fn: ValueLossFn,
    aggregate_fn: AggregateFn,
) -> StepResult:
    """One critic update. ``engine`` wraps a :class:`~rlhf_learner.models.Critic`; each micro-batch is a
    :class:`~rlhf_learner.steps.ValueBatch`. Per token: ``value_loss_fn(values, old_values, returns,
    mask)``, reduced by ``aggregate_fn``.

    ``values[:, t]`` is ``Critic``'s output: the value of the state before token ``t``, aligned with
    the actor's log-probs, the positions GAE's advantages and returns are computed at."""

    def compute(mb: ValueBatch, c: WindowCounts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = mb.action_mask
        values = engine(mb.input_ids, **mb.model_inputs())
        per_token = value_loss_fn(values, mb.old_values, mb.returns, mask)
        mf = mask.to(per_token.dtype)
        loss = aggregate_fn(
            per_token, mask, global_tokens=c.global_tokens, global_seqs=c.global_seqs, dp_size=c.dp_size
        )
        return loss, {"value_loss": (per_token * mf).sum(), "values": (values.detach() * mf).sum()}

    return run_window(
        engine,
        micro_batches,
        batch_type=ValueBatch,
        count=lambda mb: masked_counts(mb.action_mask),
        compute=compute,
        token_metrics=("value_loss", "values"),
    )
