"""Small example environments for :class:`~rlhf_rollout.executors.MultiTurnExecutor`."""

from rlhf_rollout.envs.number_guess import NumberGuessEnv

__all__ = ["NumberGuessEnv"]
