"""Advantage estimators selected by ``--algo.advantage.estimator``, in one typed registry.

Every estimator runs the same pipeline, configured by data, never by special cases:
raw scores -> (optional) reward clip -> (optional) group shaping -> per-token rewards with KL
penalty -> GAE with a critic, or discounted returns without -> (optional) global whitening.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch

from rlhf_algos.masked import masked_whiten
from rlhf_algos.returns import discounted_returns, gae
from rlhf_algos.rewards import GroupShaping, group_shaped_rewards, token_level_rewards

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BUILTIN_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "EstimatorName",
    "compute_advantages",
    "register_estimator",
]


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """One rollout batch. Rows are grouped by prompt: rows ``[k*n, (k+1)*n)`` share prompt ``k``."""

    scores: torch.Tensor
    """``[batch]`` sequence rewards."""
    mask: torch.Tensor
    """``[batch, time]`` action mask (policy tokens; may have holes for environment tokens)."""
    n_samples_per_prompt: int = 1
    kl: torch.Tensor | None = None
    """``[batch, time]`` per-token KL to the reference policy, for the in-reward KL penalty."""
    values: torch.Tensor | None = None
    """``[batch, time]`` critic values; required by estimators that use a critic."""


@dataclass(frozen=True, kw_only=True)
class AdvantageEstimator:
    """How one named estimator turns scores into advantages and returns."""

    name: str
    group_shaping: GroupShaping | None
    """Group-relative reward shaping, or ``None`` to use raw scores."""
    uses_critic: bool
    """GAE over critic values when True; discounted reward-to-go when False."""
    whiten: bool
    """Normalise advantages over the whole batch (mean 0, std 1)."""
    rewarded: bool = True
    """False: the sequence scores are not used (on-policy distillation, whose signal is the teacher's
    per-token log-probs: ``rlhf_algos.distill``); the advantages are then zero before that term."""

    def __call__(
        self,
        inputs: AdvantageInputs,
        *,
        gamma: float = 1.0,
        lam: float = 1.0,
        kl_coef: float = 0.0,
        reward_clip: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(advantages, returns)``, each ``[batch, time]``."""
        scores = inputs.scores if self.rewarded else torch.zeros_like(inputs.scores)
        if reward_clip is not None:
            if reward_clip <= 0:
                raise ValueError(f"reward_clip must be positive, got {reward_clip}")
            scores = scores.clamp(-reward_clip, reward_clip)
        if self.group_shaping is not None:
            n = inputs.n_samples_per_prompt
            if n < 2 or scores.numel() % n:
                raise ValueError(
                    f"advantage estimator {self.name!r} needs n_samples_per_prompt >= 2 dividing the batch "
                    f"({scores.numel()} rows), got {n}"
                )
            scores = group_shaped_rewards(scores.view(-1, n), self.group_shaping).reshape(-1)
        rewards = token_level_rewards(scores, inputs.mask, kl=inputs.kl, kl_coef=kl_coef)
        if self.uses_critic:
            if inputs.values is None:
                raise ValueError(f"advantage estimator {self.name!r} needs critic values (inputs.values)")
            advantages, returns = gae(rewards, inputs.values, inputs.mask, gamma=gamma, lam=lam)
        else:
            returns = discounted_returns(rewards, inputs.mask, gamma=gamma)
            advantages = returns
        if self.whiten:
            advantages = masked_whiten(advantages, inputs.mask)
        return advantages, returns


BUILTIN_ESTIMATORS: tuple[AdvantageEstimator, ...] = (
    AdvantageEstimator(name="gae", group_shaping=None, uses_critic=True, whiten=True),
    AdvantageEstimator(name="reinforce", group_shaping=None, uses_critic=False, whiten=True),
    AdvantageEstimator(
        name="reinforce_baseline", group_shaping="reinforce_baseline", uses_critic=False, whiten=True
    ),
    AdvantageEstimator(name="rloo", group_shaping="rloo", uses_critic=False, whiten=True),
    AdvantageEstimator(name="group_norm", group_shaping="group_norm", uses_critic=False, whiten=False),
    AdvantageEstimator(name="dr_grpo", group_shaping="dr_grpo", uses_critic=False, whiten=False),
    AdvantageEstimator(name="distill", group_shaping=None, uses_critic=False, whiten=False, rewarded=False),
)
"""The estimators that ship: the one place their names are written."""

EstimatorName = Literal[tuple(e.name for e in BUILTIN_ESTIMATORS)]  # type: ignore[valid-type]
"""The built-in estimators' names as a ``Literal`` built at import from :data:`BUILTIN_ESTIMATORS` (what
pydantic configurations validate against; static type checkers see it as an unknown ``Literal``)."""

_REGISTRY: dict[str, AdvantageEstimator] = {e.name: e for e in BUILTIN_ESTIMATORS}

ADVANTAGE_ESTIMATORS: Mapping[str, AdvantageEstimator] = MappingProxyType(_REGISTRY)
"""Every estimator by name, read-only (add one with :func:`register_estimator`)."""


def register_estimator(estimator: AdvantageEstimator) -> AdvantageEstimator:
    """Add an estimator under its name; a name can be registered once."""
    if estimator.name in _REGISTRY:
        raise ValueError(f"advantage estimator {estimator.name!r} is already registered")
    _REGISTRY[estimator.name] = estimator
    return estimator


def compute_advantages(
    estimator: EstimatorName | str,
    inputs: AdvantageInputs,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    kl_coef: float = 0.0,
    reward_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Look up ``estimator`` in :data:`ADVANTAGE_ESTIMATORS` and run it."""
    try:
        est = ADVANTAGE_ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; expected one of {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None
    return est(inputs, gamma=gamma, lam=lam, kl_coef=kl_coef, reward_clip=reward_clip)
