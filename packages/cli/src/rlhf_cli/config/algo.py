"""The RL algorithm: advantage estimator, KL, clipping, corrections, filters and penalties."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from rlhf_algos import (
    ADVANTAGE_ESTIMATORS,
    DistillLoss,
    ISCorrection,
    KLEstimator,
    LossAggregation,
    RatioType,
)
from rlhf_rollout import reworded
from rlhf_rollout.rewards import import_python_file

from rlhf_cli.config._base import Section

__all__ = [
    "AdvantageConfig",
    "AlgoConfig",
    "ClipConfig",
    "DistillConfig",
    "DynamicFilteringConfig",
    "ISCorrectionConfig",
    "KLConfig",
    "OverlongConfig",
]


def load_estimator_plugin(path: Path) -> None:
    """Execute ``path`` (it registers estimators with ``rlhf_algos.register_estimator``) once per process;
    errors name the file."""
    name = "_rlhf_estimators_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    if name in sys.modules:
        return
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist")
    try:
        module = import_python_file(path, what="estimator plugin")
    except RuntimeError as err:  # a validator's errors are ValueErrors (the plugin's own: its frames)
        raise reworded(err, str(err)) from None
    sys.modules[name] = module


ESTIMATOR_ALIASES = {
    "grpo": "group_norm",
    "ppo": "gae",
    "reinforce++": "reinforce",
    "reinforce++-baseline": "reinforce_baseline",
    "reinforce_plus_plus": "reinforce",
    "dr-grpo": "dr_grpo",
}
"""Names users type from the papers and other frameworks -> the registered estimator (a registered name
wins: a plugin may take one of these)."""


class AdvantageConfig(Section):
    plugin: Path | None = None
    """A Python file that registers estimators (rlhf_algos.register_estimator), run once before the
    name is checked (it is executed: pass only files you trust)."""
    estimator: str = "group_norm"
    """A name in rlhf-algos' estimator registry (`rlhf estimators` lists them): gae (needs the critic),
    reinforce, reinforce_baseline, rloo, group_norm (GRPO), dr_grpo, distill (the teacher's signal alone,
    no reward) or one --algo.advantage.plugin registers, the papers' names being read too (grpo,
    reinforce++, reinforce++-baseline, ppo for gae)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda (gae only)."""
    reward_clip: float | None = Field(None, gt=0)
    """Clip sequence rewards to [-reward_clip, reward_clip]."""

    @field_validator("plugin")
    @classmethod
    def _load_plugin(cls, path: Path | None) -> Path | None:
        if path is not None:
            load_estimator_plugin(path)
        return path

    @field_validator("estimator")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in ADVANTAGE_ESTIMATORS:
            name = ESTIMATOR_ALIASES.get(name.lower(), name)
        if name not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"{name!r} is not a registered estimator; registered: {', '.join(sorted(ADVANTAGE_ESTIMATORS))}"
            )
        return name


class KLConfig(Section):
    estimator: KLEstimator = "k3"
    """KL estimator: k1, k2, k3 (k1+ / k3+: straight-through variants for the KL loss)."""
    coef: float = Field(0.0, ge=0)
    """KL coefficient (initial value when adaptive); 0 switches the KL term and the reference group off."""
    use_loss: bool = False
    """Apply the KL as a loss term (GRPO style) instead of a per-token reward penalty."""
    in_reward: bool | None = None
    """Apply the KL as a per-token reward penalty; unset: whenever use_loss is off."""
    target: float | None = Field(None, gt=0)
    """Adaptive coefficient: the per-token mean KL to steer towards (Ziegler et al. state theirs per sequence); unset: fixed."""
    horizon: int = Field(10000, ge=1)
    """Adaptive coefficient: its horizon in samples."""

    @model_validator(mode="after")
    def _one_place(self) -> KLConfig:
        if self.use_loss and self.in_reward:
            raise ValueError(
                "kl: --algo.kl.use_loss and --algo.kl.in_reward cannot both be on (the KL would count twice)"
            )
        if self.target is not None and self.coef == 0:
            raise ValueError("kl: --algo.kl.target needs an initial --algo.kl.coef > 0")
        if self.coef > 0 and not self.use_loss and self.in_reward is False:
            raise ValueError(
                "kl: --algo.kl.coef > 0 with --algo.kl.in_reward false and no --algo.kl.use_loss applies the KL nowhere"
            )
        if self.target is not None and self.use_loss:
            raise ValueError(
                "kl: --algo.kl.target (adaptive KL) steers the in-reward penalty; it cannot be used with --algo.kl.use_loss"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.coef > 0

    @property
    def reward_penalty(self) -> bool:
        return self.enabled and (self.in_reward if self.in_reward is not None else not self.use_loss)


class ClipConfig(Section):
    eps_low: float = Field(0.2, ge=0)
    """PPO clip range below 1."""
    eps_high: float | None = Field(None, ge=0)
    """PPO clip range above 1 (clip-higher, DAPO); unset: eps_low."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip bound for negative advantages (> 1)."""
    ratio_type: RatioType = "token"
    """token (PPO) or sequence (GSPO; use eps around 3e-4)."""
    value_eps: float | None = Field(0.2, gt=0)
    """Critic value clip range; unset: no value clipping."""


class ISCorrectionConfig(Section):
    mode: ISCorrection | Literal["none"] = "none"
    """Engine-vs-learner log-prob correction: none, tis, icepop or seq-mask-tis."""
    low: float = Field(0.0, ge=0)
    """Lower bound of the importance ratio."""
    high: float = Field(2.0, gt=0)
    """Upper bound of the importance ratio."""


class DynamicFilteringConfig(Section):
    enable: bool = False
    """DAPO dynamic sampling: drop prompt groups whose mean score is outside (low, high), sample more."""
    low: float = 0.0
    """Keep groups whose mean score is above this."""
    high: float = 1.0
    """Keep groups whose mean score is below this."""
    max_rounds: int = Field(4, ge=1)
    """Sampling rounds per step at most; a batch still short then is filled with dropped groups."""


class OverlongConfig(Section):
    buffer_length: int = Field(0, ge=0)
    """DAPO soft overlong penalty over the last N tokens before max_new_tokens; 0: off."""
    penalty_factor: float = Field(1.0, ge=0)
    """Penalty at max_new_tokens."""


class DistillConfig(Section):
    coef: float = Field(1.0, ge=0)
    """Weight of the teacher's per-token advantage (its log-prob minus the policy's, rlhf_algos'
    distill_advantages), added to the estimator's; with top_k, the weight of the divergence in the loss.
    --teacher.pretrain switches it on."""
    discount: float = Field(0.0, ge=0, le=1)
    """Discount of the later tokens' terms in each token's advantage (0: each token its own)."""
    top_k: int | None = Field(None, ge=1)
    """Dense distillation: the teacher scores its k most likely tokens at each sampled token, and the loss
    adds coef x the student's divergence (loss) from that distribution (the rest of the vocabulary as one
    outcome), in place of the sampled-token advantage (GKD's on-policy variant). Unset: the advantage."""
    loss: DistillLoss = "reverse_kl"
    """With top_k: reverse_kl (KL(student || teacher), what the advantage estimates), forward_kl or jsd."""
    beta: float = Field(0.5, gt=0, lt=1)
    """jsd's teacher weight (with top_k and --algo.distill.loss jsd)."""


class AlgoConfig(Section):
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    clip: ClipConfig = Field(default_factory=ClipConfig)
    is_correction: ISCorrectionConfig = Field(default_factory=ISCorrectionConfig)
    dynamic_filtering: DynamicFilteringConfig = Field(default_factory=DynamicFilteringConfig)
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    stop_penalty: float | None = None
    """Responses cut at max_new_tokens: reward x coef (coef >= 0) or replaced by coef (coef < 0)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    loss_agg: LossAggregation = "token-mean"
    """Policy loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm
    (the seq-mean ones need --train.packing false: one sequence per row)."""
