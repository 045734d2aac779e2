"""Between the stages: the learner groups score the samples, rlhf-algos turns scores into advantages."""

from __future__ import annotations

import time

import torch
from rlhf_algos import AdvantageInputs, approx_kl, compute_advantages, masked_mean

from rlhf_cli.batches import Sample, pad_stack
from rlhf_cli.config import PPOConfig
from rlhf_cli.groups import LearnerGroup

__all__ = ["make_experience"]


def make_experience(
    cfg: PPOConfig,
    samples: list[Sample],
    *,
    actor: LearnerGroup,
    ref: LearnerGroup | None,
    critic: LearnerGroup | None,
    kl_coef: float,
) -> dict[str, float]:
    """Fill each sample's ``old_logp`` / ``ref_logp`` / ``values`` / ``advantages`` / ``returns`` and
    return the step's metrics (KL, engine-vs-learner log-prob mismatch, advantage statistics)."""
    mbs, packing = cfg.train.micro_batch_size, cfg.train.packing
    seqs = [s.token_ids for s in samples]
    t0 = time.perf_counter()
    for s, lp in zip(samples, actor.forward(seqs, micro_batch_size=mbs, packing=packing), strict=True):
        s.old_logp = lp
    t_actor = time.perf_counter() - t0
    t0 = time.perf_counter()
    if ref is not None:
        for s, lp in zip(samples, ref.forward(seqs, micro_batch_size=mbs, packing=packing), strict=True):
            s.ref_logp = lp
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    if critic is not None:
        for s, v in zip(samples, critic.forward(seqs, micro_batch_size=mbs, packing=packing), strict=True):
            s.values = v
    t_critic = time.perf_counter() - t0

    mask = pad_stack([s.action_mask for s in samples])
    old = pad_stack([s.old_logp for s in samples])
    rollout = pad_stack([s.rollout_logp for s in samples])
    kl = (
        approx_kl(old, pad_stack([s.ref_logp for s in samples]), cfg.algo.kl.estimator)
        if ref is not None
        else None
    )
    values = pad_stack([s.values for s in samples]) if critic is not None else None
    adv, ret = compute_advantages(
        cfg.algo.advantage.estimator,
        AdvantageInputs(
            scores=torch.tensor([s.reward for s in samples]),
            mask=mask,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            kl=kl,
            values=values,
        ),
        gamma=cfg.algo.advantage.gamma,
        lam=cfg.algo.advantage.lam,
        kl_coef=kl_coef if cfg.algo.kl.reward_penalty else 0.0,
        reward_clip=cfg.algo.advantage.reward_clip,
    )
    for i, s in enumerate(samples):
        n = s.length
        s.advantages, s.returns = adv[i, :n].clone(), ret[i, :n].clone()
    gap = (old - rollout).abs()[mask.bool()]
    metrics = {
        "sync/logp_mismatch_mean": float(gap.mean()),
        "sync/logp_mismatch_max": float(gap.max()),
        "advantages/mean": float(masked_mean(adv, mask)),
        "advantages/abs_mean": float(masked_mean(adv.abs(), mask)),
        "time/reference": t_ref,
        "time/learner_forward": t_actor + t_critic,
    }
    if kl is not None:
        metrics["policy/kl"] = float(masked_mean(kl, mask))
        metrics["policy/kl_coef"] = kl_coef
    return metrics
