"""Stage 2 of a PPO step: samples -> per-rank typed micro-batches -> actor and critic updates."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from rlhf_learner import balance_micro_batches

from rlhf_cli.batches import Sample, policy_batch, value_batch
from rlhf_cli.config import PPOConfig
from rlhf_cli.groups import LearnerGroup, PolicyLossSettings

__all__ = ["micro_batches", "policy_settings", "update_critic", "update_policy"]

B = TypeVar("B")


def micro_batches(
    samples: Sequence[Sample],
    group: LearnerGroup,
    *,
    micro_batch_size: int,
    dynamic: bool,
    build: Callable[[list[Sample]], B],
) -> list[list[B]]:
    """Each rank's shard cut into ``len(shard) / micro_batch_size`` micro-batches: equal sample counts,
    or (``dynamic``) near-equal token counts."""
    out = []
    for shard in group.shards(samples):
        count = len(shard) // micro_batch_size
        if dynamic:
            parts = balance_micro_batches([s.length for s in shard], count)
        else:
            parts = [list(range(i * micro_batch_size, (i + 1) * micro_batch_size)) for i in range(count)]
        out.append([build([shard[i] for i in part]) for part in parts])
    return out


def policy_settings(cfg: PPOConfig, *, kl_coef: float) -> PolicyLossSettings:
    a = cfg.algo
    return PolicyLossSettings(
        clip_eps_low=a.clip.eps_low,
        clip_eps_high=a.clip.eps_high,
        dual_clip=a.clip.dual_clip,
        ratio_type=a.clip.ratio_type,
        entropy_coef=a.entropy_coef,
        loss_agg=a.loss_agg,
        horizon=cfg.rollout.max_new_tokens,
        kl_estimator=a.kl.estimator,
        kl_loss_coef=kl_coef if (a.kl.enabled and a.kl.use_loss) else 0.0,
        is_correction=a.is_correction.mode,
        is_low=a.is_correction.low,
        is_high=a.is_correction.high,
    )


def update_policy(
    cfg: PPOConfig, samples: Sequence[Sample], actor: LearnerGroup, *, kl_coef: float
) -> dict[str, float]:
    settings = policy_settings(cfg, kl_coef=kl_coef)
    with_ref = settings.kl_loss_coef > 0
    with_rollout = settings.is_correction != "none"
    batches = micro_batches(
        samples,
        actor,
        micro_batch_size=cfg.train.micro_batch_size,
        dynamic=cfg.train.dynamic_batch,
        build=lambda part: policy_batch(
            part, packing=cfg.train.packing, with_ref=with_ref, with_rollout=with_rollout
        ),
    )
    result = actor.train_policy(batches, settings=settings)
    out = {"actor/loss": result.loss, **{f"actor/{k}": v for k, v in result.metrics.items()}}
    if result.grad_norm is not None:
        out["actor/grad_norm"] = result.grad_norm
    return out


def update_critic(cfg: PPOConfig, samples: Sequence[Sample], critic: LearnerGroup) -> dict[str, float]:
    batches = micro_batches(
        samples,
        critic,
        micro_batch_size=cfg.train.micro_batch_size,
        dynamic=cfg.train.dynamic_batch,
        build=lambda part: value_batch(part, packing=cfg.train.packing),
    )
    result = critic.train_value(batches, clip_eps=cfg.algo.clip.value_eps)
    return {"critic/loss": result.loss, **{f"critic/{k}": v for k, v in result.metrics.items()}}
