"""Agent executors: prompts in, token-level trajectories out."""

from rlhf_rollout.executors.base import AgentExecutorBase, Trajectory
from rlhf_rollout.executors.multi_turn import AgentEnv, MultiTurnExecutor, StepResult, chat_feedback_tokens
from rlhf_rollout.executors.openai_agent import OpenAIAgentExecutor, trajectories_from_records
from rlhf_rollout.executors.single_turn import SingleTurnExecutor

__all__ = [
    "AgentEnv",
    "AgentExecutorBase",
    "MultiTurnExecutor",
    "OpenAIAgentExecutor",
    "SingleTurnExecutor",
    "StepResult",
    "Trajectory",
    "chat_feedback_tokens",
    "trajectories_from_records",
]
