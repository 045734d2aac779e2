"""Model wrappers over transformers models: actor / reference log-probs, critic values, rewards."""

from rlhf_learner.models.actor import Actor, ActorOutput, load_causal_lm, load_reference
from rlhf_learner.models.loading import ModelOptions, check_model_dir, check_sequence_length
from rlhf_learner.models.logprobs import entropy_from_logits, shift_to_inputs, token_logprobs
from rlhf_learner.models.value import (
    Critic,
    RewardModel,
    has_score_head,
    last_token_index,
    load_critic,
    load_reward_model,
)

__all__ = [
    "Actor",
    "ActorOutput",
    "Critic",
    "ModelOptions",
    "RewardModel",
    "check_model_dir",
    "check_sequence_length",
    "entropy_from_logits",
    "has_score_head",
    "last_token_index",
    "load_causal_lm",
    "load_critic",
    "load_reference",
    "load_reward_model",
    "shift_to_inputs",
    "token_logprobs",
]
