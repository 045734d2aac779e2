"""rlhf-learner: DeepSpeed ZeRO models and update steps, sample packing, ring attention, LoRA, checkpoints.

Submodules: ``strategy`` (options, distributed init, ZeRO, gather, checkpoints, export), ``models``
(actor / reference / critic / reward model), ``steps`` (PPO actor and critic, SFT, RM, DPO, KTO),
``packing``, ``ring_attention``, ``lora``. The learner takes loss math as functions and imports no
sibling package.
"""

from rlhf_learner.lora import LoraOptions, apply_lora, merge_adapter, save_adapter
from rlhf_learner.models import (
    Actor,
    Critic,
    ModelOptions,
    RewardModel,
    load_causal_lm,
    load_critic,
    load_reference,
    load_reward_model,
)
from rlhf_learner.packing import balance_micro_batches, pack_sequences, unpack
from rlhf_learner.steps import (
    DistillBatch,
    DPOBatch,
    KTOBatch,
    ModelRows,
    NonFiniteLossError,
    PolicyBatch,
    RewardBatch,
    SFTBatch,
    StepResult,
    ValueBatch,
    critic_step,
    distill_divergences,
    distill_step,
    dpo_step,
    kto_step,
    ppo_actor_step,
    reward_model_step,
    sft_step,
    student_logp_at,
    teacher_distributions,
    top_tokens,
)
from rlhf_learner.strategy import Strategy, StrategyOptions, build_ds_config, gather_params, init_distributed

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "Critic",
    "DPOBatch",
    "DistillBatch",
    "KTOBatch",
    "LoraOptions",
    "ModelOptions",
    "ModelRows",
    "NonFiniteLossError",
    "PolicyBatch",
    "RewardBatch",
    "RewardModel",
    "SFTBatch",
    "StepResult",
    "Strategy",
    "StrategyOptions",
    "ValueBatch",
    "apply_lora",
    "balance_micro_batches",
    "build_ds_config",
    "critic_step",
    "distill_divergences",
    "distill_step",
    "dpo_step",
    "gather_params",
    "init_distributed",
    "kto_step",
    "load_causal_lm",
    "load_critic",
    "load_reference",
    "load_reward_model",
    "merge_adapter",
    "pack_sequences",
    "ppo_actor_step",
    "reward_model_step",
    "save_adapter",
    "sft_step",
    "student_logp_at",
    "teacher_distributions",
    "top_tokens",
    "unpack",
]
