"""Each update step's loss functions, bound from its settings (rlhf-algos math, rlhf-learner steps)."""

from __future__ import annotations

import functools
from typing import Any

from rlhf_cli.runtime.learners.specs import (
    DistillSettings,
    DPOSettings,
    KTOSettings,
    PolicyLossSettings,
    ValueLossSettings,
)

__all__ = ["distill_divergence_fn", "dpo_step_args", "kto_step_args", "policy_step_args", "value_step_args"]


def policy_step_args(s: PolicyLossSettings) -> dict[str, Any]:
    """Keyword arguments of ``rlhf_learner.ppo_actor_step`` for ``s``."""
    from rlhf_algos import aggregate_loss, approx_kl, policy_loss, vllm_is_weights

    is_fn = None
    if s.is_correction != "none":
        is_fn = functools.partial(vllm_is_weights, mode=s.is_correction, low=s.is_low, high=s.is_high)
    return {
        "policy_loss_fn": functools.partial(
            policy_loss,
            clip_eps_low=s.clip_eps_low,
            clip_eps_high=s.clip_eps_high,
            dual_clip=s.dual_clip,
            ratio_type=s.ratio_type,
        ),
        "aggregate_fn": functools.partial(aggregate_loss, mode=s.loss_agg, horizon=s.horizon),
        "kl_loss_fn": functools.partial(approx_kl, estimator=s.kl_estimator) if s.kl_loss_coef else None,
        "kl_coef": s.kl_loss_coef,
        "entropy_coef": s.entropy_coef,
        "is_weights_fn": is_fn,
        "aux_loss_coef": s.aux_loss_coef,
        "distill_fn": distill_divergence_fn(s.distill) if s.distill is not None else None,
        "distill_coef": s.distill_coef,
    }


def value_step_args(s: ValueLossSettings) -> dict[str, Any]:
    """Keyword arguments of ``rlhf_learner.critic_step``."""
    from rlhf_algos import aggregate_loss, value_loss

    return {
        "value_loss_fn": functools.partial(value_loss, clip_eps=s.clip_eps),
        "aggregate_fn": functools.partial(aggregate_loss, mode="token-mean"),
    }


def dpo_step_args(s: DPOSettings) -> dict[str, Any]:
    """Keyword arguments of ``rlhf_learner.dpo_step``."""
    from rlhf_algos import dpo_loss

    fn = functools.partial(dpo_loss, beta=s.beta, variant=s.loss, label_smoothing=s.label_smoothing)
    return {"dpo_loss_fn": fn, "nll_coef": s.nll_coef}


def kto_step_args(s: KTOSettings) -> dict[str, Any]:
    """Keyword arguments of ``rlhf_learner.kto_step``."""
    from rlhf_algos import kto_kl_baseline, kto_loss

    fn = functools.partial(
        kto_loss, beta=s.beta, desirable_weight=s.desirable_weight, undesirable_weight=s.undesirable_weight
    )
    return {"kto_loss_fn": fn, "kl_baseline_fn": kto_kl_baseline}


def distill_divergence_fn(s: DistillSettings) -> Any:
    """The divergence ``rlhf_learner.distill_step`` takes: ``s.loss`` between the two distributions, each
    renormalised over the K tokens given (no change when they are the whole vocabulary)."""
    from rlhf_algos import token_divergence, with_rest

    def divergence(student_logp: Any, teacher_logp: Any) -> Any:
        return token_divergence(with_rest(student_logp), with_rest(teacher_logp), loss=s.loss, beta=s.beta)  # type: ignore[arg-type]

    return divergence
