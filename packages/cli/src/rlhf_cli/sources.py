"""Where rewards and rollouts come from: the built-in task, a reward_func file, remote endpoints, a
reward model, or an agent file (single-turn reward_func or multi-turn make_env)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_rollout import (
    AgentExecutorBase,
    MultiTurnExecutor,
    RemoteReward,
    RewardFunction,
    SamplingParams,
    SingleTurnExecutor,
    TokenGenerator,
)
from rlhf_rollout.rewards import import_python_file

from rlhf_cli import task
from rlhf_cli.config import PPOConfig
from rlhf_cli.config.models import REWARD_TOKEN_ENV

__all__ = ["ExecutorFactory", "executor_factory", "load_agent_file"]


def load_agent_file(path: Path) -> Any:
    """Import an agent file; it must define ``make_env()`` (multi-turn) or ``reward_func`` (single-turn).
    The file is executed: only pass files you trust."""
    try:
        module = import_python_file(path, what="agent file")
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        raise ValueError(f"--train.agent_func_path: {err}") from None
    if not callable(getattr(module, "make_env", None)) and not callable(getattr(module, "reward_func", None)):
        raise ValueError(f"--train.agent_func_path: {str(path)!r} defines neither make_env() nor reward_func")
    return module


def _reward_source(cfg: PPOConfig) -> Any:
    if cfg.builtin_task:
        return RewardFunction(task.reward_func, name=f"built-in {task.TASK_NAME} reward")
    if cfg.reward.func is not None:
        try:
            return RewardFunction.from_file(cfg.reward.func)
        except (FileNotFoundError, ValueError, RuntimeError) as err:
            raise ValueError(f"--reward.func: {err}") from None
    if cfg.reward.remote_url:
        try:
            token = os.environ.get(REWARD_TOKEN_ENV)
            headers = {"Authorization": f"Bearer {token}"} if token else None
            return RemoteReward(cfg.reward.remote_url, timeout_s=cfg.reward.timeout_s, headers=headers)
        except ValueError as err:
            raise ValueError(f"--reward.remote_url: {err}") from None
    return None  # a reward model group scores the samples, or the environment rewards them


ExecutorFactory = Callable[[Any, SamplingParams], AgentExecutorBase]
"""``(engine, params) -> executor``."""


def executor_factory(cfg: PPOConfig, *, tokenizer: Any) -> ExecutorFactory:
    """``(engine, params) -> executor`` for the configured rollout. Files are loaded (and checked) here,
    before anything starts."""
    agent = load_agent_file(cfg.train.agent_func_path) if cfg.train.agent_func_path is not None else None
    if agent is not None and callable(getattr(agent, "make_env", None)):
        limit = cfg.vllm.max_model_len

        def multi(engine: TokenGenerator, params: SamplingParams) -> AgentExecutorBase:
            return MultiTurnExecutor(
                engine=engine,
                params=params,
                tokenizer=tokenizer,
                env_factory=agent.make_env,
                max_turns=cfg.train.max_turns,
                max_length=limit,
            )

        return multi
    reward = (
        RewardFunction(agent.reward_func, name=f"reward_func in {cfg.train.agent_func_path}")
        if agent
        else _reward_source(cfg)
    )

    def single(engine: TokenGenerator, params: SamplingParams) -> AgentExecutorBase:
        return SingleTurnExecutor(engine=engine, params=params, tokenizer=tokenizer, reward=reward)

    return single
