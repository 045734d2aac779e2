"""rlhf-algos: pure-function RLHF math on torch tensors.

Each formula is one function whose docstring states the math and cites the paper.
"""

from rlhf_algos.aggregate import LossAggregation, aggregate_loss, sft_loss
from rlhf_algos.correction import ISCorrection, vllm_is_weights
from rlhf_algos.distill import (
    DistillLoss,
    distill_advantages,
    generalized_jsd,
    reverse_kl,
    token_divergence,
    with_rest,
)
from rlhf_algos.estimators import (
    ADVANTAGE_ESTIMATORS,
    BUILTIN_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    EstimatorName,
    compute_advantages,
    register_estimator,
)
from rlhf_algos.filters import dynamic_filter
from rlhf_algos.kl import AdaptiveKLController, FixedKLController, KLEstimator, approx_kl
from rlhf_algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf_algos.policy import PolicyLossOutput, RatioType, policy_loss, value_loss
from rlhf_algos.preference import (
    DPOLossOutput,
    DPOVariant,
    dpo_loss,
    kto_kl_baseline,
    kto_loss,
    pairwise_rm_loss,
)
from rlhf_algos.returns import discounted_returns, gae
from rlhf_algos.rewards import (
    GroupShaping,
    group_shaped_rewards,
    overlong_penalty,
    stop_penalty,
    token_level_rewards,
)

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BUILTIN_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageInputs",
    "DPOLossOutput",
    "DPOVariant",
    "DistillLoss",
    "EstimatorName",
    "FixedKLController",
    "GroupShaping",
    "ISCorrection",
    "KLEstimator",
    "LossAggregation",
    "PolicyLossOutput",
    "RatioType",
    "aggregate_loss",
    "approx_kl",
    "compute_advantages",
    "discounted_returns",
    "distill_advantages",
    "dpo_loss",
    "dynamic_filter",
    "gae",
    "generalized_jsd",
    "group_shaped_rewards",
    "kto_kl_baseline",
    "kto_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "pairwise_rm_loss",
    "policy_loss",
    "register_estimator",
    "reverse_kl",
    "sft_loss",
    "stop_penalty",
    "token_divergence",
    "token_level_rewards",
    "value_loss",
    "vllm_is_weights",
    "with_rest",
]
