"""Update steps: PPO actor and critic, SFT, reward model, DPO, KTO, distillation.

Each step takes typed micro-batches (``PolicyBatch``, ``ValueBatch``, ``SFTBatch``, ``RewardBatch``,
``DPOBatch``, ``KTOBatch``, ``DistillBatch``: shapes checked when built) and its loss function as an argument (the
learner does not import rlhf-algos), and normalises the loss over the whole gradient-accumulation window and all data-parallel ranks.
"""

from rlhf_learner.steps._window import (
    NonFiniteLossError,
    StepResult,
    TrainEngine,
    WindowCounts,
    loss_tensor,
    masked_counts,
    run_window,
)
from rlhf_learner.steps.batches import (
    DistillBatch,
    DPOBatch,
    KTOBatch,
    ModelRows,
    PolicyBatch,
    RewardBatch,
    SFTBatch,
    ValueBatch,
)
from rlhf_learner.steps.distill import (
    distill_divergences,
    distill_step,
    student_logp_at,
    teacher_distributions,
    top_tokens,
)
from rlhf_learner.steps.losses import (
    AggregateFn,
    DivergenceFn,
    DPOLossFn,
    ISWeightsFn,
    KLBaselineFn,
    KLLossFn,
    KTOLossFn,
    PairLossFn,
    PolicyLossFn,
    SFTLossFn,
    ValueLossFn,
)
from rlhf_learner.steps.ppo import critic_step, ppo_actor_step
from rlhf_learner.steps.reference import reference_logp, reference_sequence_logp
from rlhf_learner.steps.supervised import dpo_step, kto_step, reward_model_step, sequence_logp, sft_step

__all__ = [
    "AggregateFn",
    "DPOBatch",
    "DPOLossFn",
    "DistillBatch",
    "DivergenceFn",
    "ISWeightsFn",
    "KLBaselineFn",
    "KLLossFn",
    "KTOBatch",
    "KTOLossFn",
    "ModelRows",
    "NonFiniteLossError",
    "PairLossFn",
    "PolicyBatch",
    "PolicyLossFn",
    "RewardBatch",
    "SFTBatch",
    "SFTLossFn",
    "StepResult",
    "TrainEngine",
    "ValueBatch",
    "ValueLossFn",
    "WindowCounts",
    "critic_step",
    "distill_divergences",
    "distill_step",
    "dpo_step",
    "kto_step",
    "loss_tensor",
    "masked_counts",
    "ppo_actor_step",
    "reference_logp",
    "reference_sequence_logp",
    "reward_model_step",
    "run_window",
    "sequence_logp",
    "sft_step",
    "student_logp_at",
    "teacher_distributions",
    "top_tokens",
]
