"""The update stage of a PPO step: samples -> per-rank typed micro-batches -> actor and critic updates."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rlhf_cli.config import PPOConfig
from rlhf_cli.data.batches import Sample, policy_batch, value_batch
from rlhf_cli.runtime.protocols import PolicyGroup, ScoringGroup, ValueGroup
from rlhf_cli.runtime.specs import PolicyLossSettings, ValueLossSettings
from rlhf_learner import StepResult, balance_micro_batches

__all__ = ["Updates", "micro_batches", "policy_settings", "update"]

B = TypeVar("B")


@dataclass(kw_only=True)
class Updates:
    """The step's last actor and critic results (one per PPO epoch is run) and the stage's seconds."""

    actor: StepResult
    critic: StepResult | None
    seconds: float

    def metrics(self) -> dict[str, float]:
        out = {"actor/loss": self.actor.loss, **{f"actor/{k}": v for k, v in self.actor.metrics.items()}}
        if self.actor.grad_norm is not None:
            out["actor/grad_norm"] = self.actor.grad_norm
        if self.critic is not None:
            out |= {
                "critic/loss": self.critic.loss,
                **{f"critic/{k}": v for k, v in self.critic.metrics.items()},
            }
        return out


def micro_batches(
    samples: Sequence[Sample],
    group: ScoringGroup,
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
        aux_loss_coef=cfg.actor.aux_loss_coef,
    )


def update_policy(
    cfg: PPOConfig, samples: Sequence[Sample], actor: PolicyGroup, *, kl_coef: float
) -> StepResult:
    settings = policy_settings(cfg, kl_coef=kl_coef)
    with_ref, with_rollout = settings.kl_loss_coef > 0, settings.is_correction != "none"
    batches = micro_batches(
        samples,
        actor,
        micro_batch_size=cfg.train.micro_batch_size,
        dynamic=cfg.train.dynamic_batch,
        build=lambda part: policy_batch(
            part, packing=cfg.train.packing, with_ref=with_ref, with_rollout=with_rollout
        ),
    )
    return actor.train_policy(batches, settings=settings)


def update_critic(cfg: PPOConfig, samples: Sequence[Sample], critic: ValueGroup) -> StepResult:
    batches = micro_batches(
        samples,
        critic,
        micro_batch_size=cfg.train.micro_batch_size,
        dynamic=cfg.train.dynamic_batch,
        build=lambda part: value_batch(part, packing=cfg.train.packing),
    )
    return critic.train_value(batches, settings=ValueLossSettings(clip_eps=cfg.algo.clip.value_eps))


def update(
    cfg: PPOConfig,
    samples: Sequence[Sample],
    *,
    actor: PolicyGroup,
    critic: ValueGroup | None,
    kl_coef: float,
) -> Updates:
    """``--train.ppo_epochs`` passes of the actor (and critic) update over the samples."""
    t0 = time.perf_counter()
    actor_res, critic_res = None, None
    for _ in range(cfg.train.ppo_epochs):
        actor_res = update_policy(cfg, samples, actor, kl_coef=kl_coef)
        if critic is not None:
            critic_res = update_critic(cfg, samples, critic)
    return Updates(actor=actor_res, critic=critic_res, seconds=time.perf_counter() - t0)
