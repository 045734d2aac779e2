"""Model wrappers over transformers models: actor / reference log-probs, critic values, rewards."""

from rlhf_learner.models.actor import Actor, ActorOutput, load_causal_lm, load_reference
from rlhf_learner.models.loading import ModelOptions, check_model_dir, check_sequence_length
from rlhf_learner.models.logprobs import (
    entropy_from_logits,
    next_token_logprobs,
    shift_to_inputs,
    token_logprobs,
)
from rlhf_learner.models.value import (
    Critic,
    RewardModel,
    VisionValueModel,
    has_score_head,
    last_token_index,
    load_critic,
    load_reward_model,
)
from rlhf_learner.models.vision import (
    VISION_LANGUAGE_TYPES,
    freeze_vision_tower,
    is_vision_language,
    trained_parameters,
)

__all__ = [
    "VISION_LANGUAGE_TYPES",
    "Actor",
    "ActorOutput",
    "Critic",
    "ModelOptions",
    "RewardModel",
    "VisionValueModel",
    "check_model_dir",
    "check_sequence_length",
    "entropy_from_logits",
    "freeze_vision_tower",
    "has_score_head",
    "is_vision_language",
    "last_token_index",
    "load_causal_lm",
    "load_critic",
    "load_reference",
    "load_reward_model",
    "next_token_logprobs",
    "shift_to_inputs",
    "token_logprobs",
    "trained_parameters",
]
