"""The experience stage of a PPO step: the learner groups score the samples (old-policy and reference
log-probs, values), rlhf-algos turns scores into advantages and returns."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rlhf_algos import (
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    approx_kl,
    compute_advantages,
    masked_mean,
)
from rlhf_cli.config import PPOConfig
from rlhf_cli.config.algo import KLConfig
from rlhf_cli.data.batches import Sample, pad_stack
from rlhf_cli.runtime.protocols import ScoringGroup

__all__ = ["Experience", "make_experience", "make_kl_controller"]


@dataclass(kw_only=True)
class Experience:
    """The samples with ``old_logp`` / ``ref_logp`` / ``values`` / ``advantages`` / ``returns`` filled in,
    and what the stage measured."""

    samples: list[Sample]
    kl_mean: float | None
    """Mean per-token KL to the reference over the sampled tokens (None without a reference)."""
    kl_coef: float
    logp_mismatch_mean: float
    logp_mismatch_max: float
    advantage_mean: float
    advantage_abs_mean: float
    forward_s: float
    """Seconds of the actor's and critic's forwards (the reference's are ``reference_s``)."""
    reference_s: float

    def metrics(self) -> dict[str, float]:
        out = {
            "sync/logp_mismatch_mean": self.logp_mismatch_mean,
            "sync/logp_mismatch_max": self.logp_mismatch_max,
            "advantages/mean": self.advantage_mean,
            "advantages/abs_mean": self.advantage_abs_mean,
            "time/reference": self.reference_s,
        }
        if self.kl_mean is not None:
            out |= {"policy/kl": self.kl_mean, "policy/kl_coef": self.kl_coef}
        return out


def make_kl_controller(kl: KLConfig, *, value: float) -> AdaptiveKLController | FixedKLController:
    """Adaptive (Ziegler et al. 2019) when ``--algo.kl.target`` is set, else fixed at ``value``."""
    if kl.target is not None:
        return AdaptiveKLController(value=value, target=kl.target, horizon=kl.horizon)
    return FixedKLController(value=value)


def _score(group: ScoringGroup | None, seqs: list[torch.Tensor], cfg: PPOConfig) -> tuple[list | None, float]:
    """``group``'s per-sequence forward (None without a group) and its seconds."""
    t0 = time.perf_counter()
    if group is None:
        return None, 0.0
    out = group.forward(seqs, micro_batch_size=cfg.train.micro_batch_size, packing=cfg.train.packing)
    return out, time.perf_counter() - t0


def make_experience(
    cfg: PPOConfig,
    samples: Sequence[Sample],
    *,
    actor: ScoringGroup,
    ref: ScoringGroup | None,
    critic: ScoringGroup | None,
    kl_coef: float,
) -> Experience:
    seqs = [s.token_ids for s in samples]
    old, t_actor = _score(actor, seqs, cfg)
    ref_logp, t_ref = _score(ref, seqs, cfg)
    values, t_critic = _score(critic, seqs, cfg)
    for i, s in enumerate(samples):
        s.old_logp = old[i]
        if ref_logp is not None:
            s.ref_logp = ref_logp[i]
        if values is not None:
            s.values = values[i]
    mask = pad_stack([s.action_mask for s in samples])
    old_t = pad_stack([s.old_logp for s in samples])
    kl = (
        approx_kl(old_t, pad_stack([s.ref_logp for s in samples]), cfg.algo.kl.estimator)
        if ref is not None
        else None
    )
    adv, ret = compute_advantages(
        cfg.algo.advantage.estimator,
        AdvantageInputs(
            scores=torch.tensor([s.reward for s in samples]),
            mask=mask,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            kl=kl,
            values=pad_stack([s.values for s in samples]) if critic is not None else None,
        ),
        gamma=cfg.algo.advantage.gamma,
        lam=cfg.algo.advantage.lam,
        kl_coef=kl_coef if cfg.algo.kl.reward_penalty else 0.0,
        reward_clip=cfg.algo.advantage.reward_clip,
    )
    for i, s in enumerate(samples):
        s.advantages, s.returns = adv[i, : s.length].clone(), ret[i, : s.length].clone()
    gap = (old_t - pad_stack([s.rollout_logp for s in samples])).abs()[mask.bool()]
    return Experience(
        samples=list(samples),
        kl_mean=float(masked_mean(kl, mask)) if kl is not None else None,
        kl_coef=kl_coef,
        logp_mismatch_mean=float(gap.mean()),
        logp_mismatch_max=float(gap.max()),
        advantage_mean=float(masked_mean(adv, mask)),
        advantage_abs_mean=float(masked_mean(adv.abs(), mask)),
        forward_s=t_actor + t_critic,
        reference_s=t_ref,
    )
