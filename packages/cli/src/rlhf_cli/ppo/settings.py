"""What each stage of a PPO step reads of the configuration: small frozen records that the recipe builds
once (``StageSettings.of``), so a stage depends on its own settings and never on the whole tree."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlhf_algos import ADVANTAGE_ESTIMATORS
from rlhf_cli.runtime.learners.specs import DistillSettings, PolicyLossSettings
from rlhf_rollout import SamplingParams

if TYPE_CHECKING:  # the builders read a configuration; the stages that take these records never import one
    from rlhf_cli.config import PPOConfig

__all__ = [
    "Batching",
    "EvalSettings",
    "ExperienceSettings",
    "RewardSettings",
    "RolloutSettings",
    "StageSettings",
    "UpdateSettings",
    "WarmupSettings",
]


@dataclass(frozen=True, kw_only=True)
class Batching:
    """How a group's forwards and updates cut a batch into micro-batches."""

    micro_batch_size: int
    packing: bool
    dynamic: bool = False
    """Balance the micro-batches by tokens (updates only)."""

    @classmethod
    def of(cls, cfg: PPOConfig) -> Batching:
        t = cfg.train
        return cls(micro_batch_size=t.micro_batch_size, packing=t.packing, dynamic=t.dynamic_batch)


@dataclass(frozen=True, kw_only=True)
class ExperienceSettings:
    """The experience stage: forwards, the KL to the reference and the advantage estimator."""

    batching: Batching
    estimator: str
    gamma: float
    lam: float
    reward_clip: float | None
    n_samples_per_prompt: int
    kl_in_reward: bool
    """Shape the rewards with the KL penalty (``--algo.kl.reward_penalty``)."""
    kl_estimator: str
    overlap_reference: bool
    """Start the reference forward and let the update fetch it (``PPOConfig.reference_overlaps_update``)."""
    on_policy: bool
    """Skip the old-policy forward (``PPOConfig.exactly_on_policy``)."""
    engine_logprobs: bool
    distill_coef: float = 0.0
    """Weight of on-policy distillation's advantage (with a teacher: ``--algo.distill.coef``)."""
    distill_discount: float = 0.0
    distill_top_k: int | None = None
    """Dense distillation: the teacher's top k at each sampled token go to the update's loss
    (``--algo.distill.top_k``); None: its sampled-token advantage."""

    @classmethod
    def of(cls, cfg: PPOConfig) -> ExperienceSettings:
        a = cfg.algo
        return cls(
            batching=Batching.of(cfg),
            estimator=a.advantage.estimator,
            gamma=a.advantage.gamma,
            lam=a.advantage.lam,
            reward_clip=a.advantage.reward_clip,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            kl_in_reward=a.kl.reward_penalty,
            kl_estimator=a.kl.estimator,
            overlap_reference=cfg.reference_overlaps_update,
            on_policy=cfg.exactly_on_policy,
            engine_logprobs=cfg.rollout.logprobs,
            distill_coef=a.distill.coef if cfg.distills else 0.0,
            distill_discount=a.distill.discount,
            distill_top_k=a.distill.top_k if cfg.distills else None,
        )


@dataclass(frozen=True, kw_only=True)
class UpdateSettings:
    """The update stage: PPO epochs over shuffled mini-batches, the policy and value losses."""

    batching: Batching
    policy_loss: PolicyLossSettings
    """The actor's loss, its KL coefficient 0 (``policy`` sets each step's)."""
    kl_loss: bool
    """The KL to the reference is a loss term (``--algo.kl.use_loss``)."""
    value_clip_eps: float | None
    engine_logprobs: bool
    mini_batch_size: int
    ppo_epochs: int
    freeze_actor_steps: int
    seed: int

    def policy(self, kl_coef: float) -> PolicyLossSettings:
        """The actor's loss at this step's KL coefficient."""
        return dataclasses.replace(self.policy_loss, kl_loss_coef=kl_coef if self.kl_loss else 0.0)

    @classmethod
    def of(cls, cfg: PPOConfig) -> UpdateSettings:
        a = cfg.algo
        loss = PolicyLossSettings(
            clip_eps_low=a.clip.eps_low,
            clip_eps_high=a.clip.eps_high,
            dual_clip=a.clip.dual_clip,
            ratio_type=a.clip.ratio_type,
            entropy_coef=a.entropy_coef,
            loss_agg=a.loss_agg,
            horizon=cfg.rollout.max_new_tokens,
            kl_estimator=a.kl.estimator,
            kl_loss_coef=0.0,
            is_correction=a.is_correction.mode,
            is_low=a.is_correction.low,
            is_high=a.is_correction.high,
            aux_loss_coef=cfg.actor.aux_loss_coef,
            distill=DistillSettings(loss=a.distill.loss, beta=a.distill.beta)
            if cfg.distills and a.distill.top_k is not None
            else None,
            distill_coef=a.distill.coef,
        )
        return cls(
            batching=Batching.of(cfg),
            policy_loss=loss,
            kl_loss=a.kl.enabled and a.kl.use_loss,
            value_clip_eps=a.clip.value_eps,
            engine_logprobs=cfg.rollout.logprobs,
            mini_batch_size=cfg.optimizer_batch_size,
            ppo_epochs=cfg.train.ppo_epochs,
            freeze_actor_steps=cfg.train.freeze_actor_steps,
            seed=cfg.train.seed,
        )


@dataclass(frozen=True, kw_only=True)
class RewardSettings:
    """The rewards stage: a reward model's micro-batches and the length penalties."""

    micro_batch_size: int
    max_new_tokens: int
    stop_penalty: float | None
    overlong_buffer: int
    overlong_penalty_factor: float

    @classmethod
    def of(cls, cfg: PPOConfig) -> RewardSettings:
        a = cfg.algo
        return cls(
            micro_batch_size=cfg.train.micro_batch_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
            stop_penalty=a.stop_penalty,
            overlong_buffer=a.overlong.buffer_length,
            overlong_penalty_factor=a.overlong.penalty_factor,
        )


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """The rollout stage: how to sample, how many prompts, and dynamic filtering (DAPO)."""

    sampling: SamplingParams
    """Each call's seed is derived from ``seed``, the step and the filtering round."""
    seed: int
    batch_size: int
    filtering: bool
    filter_low: float
    filter_high: float
    filter_rounds: int
    group_estimator: bool = True
    """The estimator compares a prompt's samples (a step where none differ teaches it nothing)."""

    @classmethod
    def of(cls, cfg: PPOConfig) -> RolloutSettings:
        r, df = cfg.rollout, cfg.algo.dynamic_filtering
        sampling = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            n=r.n_samples_per_prompt,
            seed_per_sample=r.seed_per_sample,
            logprobs=r.logprobs,
        )
        return cls(
            sampling=sampling,
            seed=cfg.train.seed,
            batch_size=r.batch_size,
            filtering=df.enable,
            filter_low=df.low,
            filter_high=df.high,
            filter_rounds=df.max_rounds if df.enable else 1,
            group_estimator=ADVANTAGE_ESTIMATORS[cfg.algo.advantage.estimator].group_shaping is not None,
        )


@dataclass(frozen=True, kw_only=True)
class EvalSettings:
    """Evaluation: how to sample the answers and when one passes."""

    sampling: SamplingParams
    pass_threshold: float
    micro_batch_size: int

    @classmethod
    def of(cls, cfg: PPOConfig) -> EvalSettings:
        e = cfg.eval
        sampling = SamplingParams(
            temperature=e.temperature,
            n=e.n_samples,
            max_new_tokens=cfg.rollout.max_new_tokens,
            logprobs=False,
            seed=cfg.train.seed if e.temperature > 0 else None,
        )
        return cls(
            sampling=sampling, pass_threshold=e.pass_threshold, micro_batch_size=cfg.train.micro_batch_size
        )


@dataclass(frozen=True, kw_only=True)
class WarmupSettings:
    """The built-in demo's supervised warm-up of the actor."""

    steps: int
    batch_size: int
    seed: int
    apply_chat_template: bool
    batching: Batching
    demo_model: str = "small"

    @classmethod
    def of(cls, cfg: PPOConfig) -> WarmupSettings:
        return cls(
            demo_model=cfg.train.demo_model,
            steps=cfg.train.warmup_sft_steps,
            batch_size=cfg.optimizer_batch_size,
            seed=cfg.train.seed,
            apply_chat_template=cfg.data.apply_chat_template,
            batching=dataclasses.replace(Batching.of(cfg), dynamic=False),
        )


@dataclass(frozen=True, kw_only=True)
class StageSettings:
    """Every stage's settings, built once from the configuration."""

    rollout: RolloutSettings
    rewards: RewardSettings
    experience: ExperienceSettings
    update: UpdateSettings
    evaluation: EvalSettings
    warmup: WarmupSettings

    @classmethod
    def of(cls, cfg: PPOConfig) -> StageSettings:
        return cls(
            rollout=RolloutSettings.of(cfg),
            rewards=RewardSettings.of(cfg),
            experience=ExperienceSettings.of(cfg),
            update=UpdateSettings.of(cfg),
            evaluation=EvalSettings.of(cfg),
            warmup=WarmupSettings.of(cfg),
        )
