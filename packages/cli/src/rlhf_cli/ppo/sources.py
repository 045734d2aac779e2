"""Where rewards and rollouts come from: the built-in task, a reward_func file, remote endpoints, a
reward model, or an agent file (single-turn reward_func, multi-turn make_env, or an OpenAI-API agent
run_agent)."""

from __future__ import annotations

import asyncio
import inspect
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from rlhf_cli.config import PPOConfig
from rlhf_cli.config.models import REWARD_TOKEN_ENV
from rlhf_cli.data.images import ImageEncoder
from rlhf_cli.demo import task
from rlhf_rollout import (
    AgentExecutorBase,
    MultiTurnExecutor,
    OpenAIAgentExecutor,
    OpenAIServer,
    RemoteReward,
    RewardFunction,
    SamplingParams,
    SingleTurnExecutor,
    TokenGenerator,
    Trajectory,
    reworded,
)
from rlhf_rollout.executors.base import agenerate, check_prompt_lengths, engine_max_model_len
from rlhf_rollout.images import prompt_images
from rlhf_rollout.rewards import check_call, import_python_file
from rlhf_rollout.types import Generation

__all__ = ["AGENT_FUNC", "ExecutorFactory", "OpenAIAgentFactory", "executor_factory", "load_agent_file"]

AGENT_FUNC = "run_agent"
"""``async def run_agent(*, base_url, api_key, prompt, label) -> float`` in an agent file: an OpenAI-API
agent (``api_key``: the run's server's bearer token, for the OpenAI client)."""
_AGENT_SIGNATURE = f"'async def {AGENT_FUNC}(*, base_url, api_key, prompt, label) -> float'"

_ENTRY_POINTS = ("make_env", AGENT_FUNC, "reward_func")


def load_agent_file(path: Path) -> Any:
    """Import an agent file; it must define ``make_env()`` (multi-turn), ``run_agent`` (an async
    OpenAI-API agent) or ``reward_func`` (single-turn). The file is executed: only pass files you trust."""
    try:
        module = import_python_file(path, what="agent file")
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        raise reworded(err, f"--train.agent_func_path: {err}") from None
    found = [name for name in _ENTRY_POINTS if callable(getattr(module, name, None))]
    if not found:
        raise ValueError(
            f"--train.agent_func_path: {str(path)!r} defines none of make_env() (multi-turn), "
            f"{AGENT_FUNC} (OpenAI-API agent) or reward_func (single-turn)"
        )
    if AGENT_FUNC in found and len(found) > 1:
        raise ValueError(f"--train.agent_func_path: {str(path)!r} defines {' and '.join(found)}: define one")
    if AGENT_FUNC in found and not _agent_signature_fits(getattr(module, AGENT_FUNC)):
        raise ValueError(f"--train.agent_func_path: {AGENT_FUNC} in {str(path)!r} must be {_AGENT_SIGNATURE}")
    if "make_env" in found:
        try:
            check_call(module.make_env, f"make_env in {str(path)!r}", "make_env()", 0, {})
        except ValueError as err:
            raise ValueError(f"--train.agent_func_path: {err}") from None
    return module


def _agent_signature_fits(agent: Callable[..., Any]) -> bool:
    """A coroutine function that takes the four keyword arguments (by name or ``**kwargs``)."""
    if not inspect.iscoroutinefunction(agent):
        return False
    params = inspect.signature(agent).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    named = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return {"base_url", "api_key", "prompt", "label"} <= named


def _reward_source(cfg: PPOConfig) -> Any:
    if cfg.builtin_task:
        demo = task.builtin_task(cfg.train.demo_model)
        return RewardFunction(demo.reward_func, name=f"built-in {demo.TASK_NAME} reward")
    if cfg.reward.func is not None:
        try:
            return RewardFunction.from_file(cfg.reward.func, timeout_s=cfg.reward.func_timeout_s)
        except (FileNotFoundError, ValueError, RuntimeError) as err:
            raise reworded(err, f"--reward.func: {err}") from None
    if cfg.reward.remote_url:
        try:
            token = os.environ.get(REWARD_TOKEN_ENV)
            headers = {"Authorization": f"Bearer {token}"} if token else None
            return RemoteReward(cfg.reward.remote_url, timeout_s=cfg.reward.timeout_s, headers=headers)
        except ValueError as err:
            raise ValueError(f"--reward.remote_url: {err}") from None
    return None  # a reward model group scores the samples, or the environment rewards them


class ExecutorFactory(Protocol):
    """``(engine, params) -> executor``; ``close()`` stops what the factory started (call it once the
    run ends, however it ends)."""

    per_episode: bool
    """Its executors call the engines once per episode and turn (multi-turn environments, OpenAI-API
    agents), so the engines should batch concurrent calls (vLLM's ``AsyncLLM``)."""

    def __call__(self, engine: Any, params: SamplingParams) -> AgentExecutorBase: ...

    def close(self) -> None: ...


class _PlainFactory:
    """A factory that starts nothing: ``close()`` does nothing."""

    def __init__(
        self, make: Callable[[Any, SamplingParams], AgentExecutorBase], *, per_episode: bool = False
    ) -> None:
        self._make, self.per_episode = make, per_episode

    def __call__(self, engine: Any, params: SamplingParams) -> AgentExecutorBase:
        return self._make(engine, params)

    def close(self) -> None:
        return None


def executor_factory(
    cfg: PPOConfig, *, tokenizer: Any, encoder: ImageEncoder | None = None, images: bool = False
) -> ExecutorFactory:
    """``(engine, params) -> executor`` for the configured rollout. Files are loaded (and checked) here,
    before anything starts. Register the result's ``close`` to run when the run ends. ``encoder``: a
    vision-language model's processor (an environment's feedback may then show images); ``images``: some
    prompts show images (an OpenAI-API agent, whose calls carry text, is then refused)."""
    factory = _factory(cfg, tokenizer, encoder)
    if images and isinstance(factory, OpenAIAgentFactory):
        raise ValueError(
            f"--train.agent_func_path: {str(cfg.train.agent_func_path)!r} defines {AGENT_FUNC} (an "
            "OpenAI-API agent, whose calls carry text only), but the prompts show images; define make_env() "
            "or reward_func instead"
        )
    if factory.per_episode and not cfg.rollout.seed_per_sample and cfg.rollout.capabilities.seeded_calls:
        raise ValueError(
            f"--rollout.seed_per_sample false seeds each engine call, but {cfg.train.agent_func_path} makes "
            "calls per episode that overlap: keep it true"
        )
    return factory


def _agent_reward(agent: Any, path: Path, timeout_s: float | None) -> RewardFunction:
    try:
        return RewardFunction(agent.reward_func, name=f"reward_func in {str(path)!r}", timeout_s=timeout_s)
    except ValueError as err:
        raise ValueError(f"--train.agent_func_path: {err}") from None


def _factory(cfg: PPOConfig, tokenizer: Any, encoder: ImageEncoder | None) -> ExecutorFactory:
    path = cfg.train.agent_func_path
    agent = load_agent_file(path) if path is not None else None
    if agent is not None and callable(getattr(agent, AGENT_FUNC, None)):
        return OpenAIAgentFactory(
            getattr(agent, AGENT_FUNC),
            path=path,
            tokenizer=tokenizer,
            timeout_s=cfg.train.agent_timeout_s,
            default_max_tokens=cfg.rollout.max_new_tokens,
        )
    if agent is not None and callable(getattr(agent, "make_env", None)):
        limit = cfg.rollout.max_model_len

        def multi(engine: TokenGenerator, params: SamplingParams) -> AgentExecutorBase:
            return MultiTurnExecutor(
                engine=engine,
                params=params,
                tokenizer=tokenizer,
                env_factory=agent.make_env,
                max_turns=cfg.train.max_turns,
                max_length=limit,
                render_images=encoder.feedback if encoder is not None else None,
            )

        return _PlainFactory(multi, per_episode=True)
    reward = _agent_reward(agent, path, cfg.reward.func_timeout_s) if agent else _reward_source(cfg)

    def single(engine: TokenGenerator, params: SamplingParams) -> AgentExecutorBase:
        return SingleTurnExecutor(engine=engine, params=params, tokenizer=tokenizer, reward=reward)

    return _PlainFactory(single)


# --- OpenAI-API agents ---------------------------------------------------------------------------------


class OpenAIAgentFactory:
    """Executors that run an agent file's ``run_agent`` against one OpenAI-compatible server on
    127.0.0.1 (a free port), started at the first call and stopped by :meth:`close`. One executor runs
    at a time: each points the server at its engine and sampling parameters when it runs."""

    def __init__(
        self,
        agent: Callable[..., Any],
        *,
        path: Path,
        tokenizer: Any,
        timeout_s: float,
        default_max_tokens: int,
    ) -> None:
        self.agent = _with_timeout(agent, timeout_s)
        self.per_episode = True  # every agent makes its own calls
        self.path = path
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self._server: OpenAIServer | None = None
        self._lock = threading.Lock()

    def __call__(self, engine: Any, params: SamplingParams) -> AgentExecutorBase:
        return _OpenAIAgentRollout(
            engine=engine, params=params, server=self.server(), agent=self.agent, path=self.path
        )

    def server(self) -> OpenAIServer:
        """The running server (started on first use)."""
        with self._lock:
            if self._server is None:
                self._server = OpenAIServer(
                    engine=None,
                    tokenizer=self.tokenizer,
                    default_max_tokens=self.default_max_tokens,
                    api_key=secrets.token_urlsafe(32),  # only the run's agents get it
                ).start()
            return self._server

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop()
                self._server = None


def _with_timeout(agent: Callable[..., Any], timeout_s: float) -> Callable[..., Any]:
    """``agent`` bounded to ``timeout_s`` seconds per episode."""

    async def timed(**kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(agent(**kwargs), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the episode took over {timeout_s} s (--train.agent_timeout_s)") from None

    return timed


class _RunSampling:
    """The engine as the agent's server sees it: every call samples at the run's temperature, top_p and
    top_k, with at most the run's max_new_tokens (and no more than the context leaves), whatever the
    request asks, so the recorded log-probs are those the learner compares with; and computes them only
    when the run asks for them (``--rollout.logprobs``)."""

    def __init__(self, engine: Any, params: SamplingParams, *, limit: int) -> None:
        self.engine, self.params, self.limit = engine, params, limit

    @property
    def max_model_len(self) -> int:
        return self.limit

    async def agenerate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Generation]]:
        check_prompt_lengths(prompts, self.limit)
        room = self.limit - max(len(p) for p in prompts)
        run = self.params
        pinned = replace(
            params,
            temperature=run.temperature,
            top_p=run.top_p,
            top_k=run.top_k,
            max_new_tokens=max(1, min(params.max_new_tokens, run.max_new_tokens, room)),
            logprobs=run.logprobs,
        )
        return await agenerate(self.engine, prompts, pinned)


class _OpenAIAgentRollout(AgentExecutorBase):
    """``params.n`` episodes of the agent per prompt, each one trajectory: the token sequence its model
    calls built (the last one, when a call did not extend the previous tokens; ``extra/agent_segments``
    counts the sequences an episode formed)."""

    def __init__(
        self, *, engine: Any, params: SamplingParams, server: OpenAIServer, agent: Any, path: Path
    ) -> None:
        super().__init__(engine=engine, params=params)
        self.server, self.agent, self.path = server, agent, path

    async def arun(
        self, prompts: Sequence[Sequence[int]], *, labels: Sequence[Any] | None = None
    ) -> list[Trajectory]:
        if any(prompt_images(p) for p in prompts):
            raise ValueError(
                f"--train.agent_func_path {str(self.path)!r}: an OpenAI-API agent gets its prompt as text; "
                "these prompts have images (use a multi-turn environment, make_env, for images)"
            )
        limit = await asyncio.to_thread(engine_max_model_len, self.engine)
        self.server.engine = _RunSampling(self.engine, self.params, limit=limit)
        decode = self.server.tokenizer.decode
        texts = [decode(list(p), skip_special_tokens=True) for p in prompts]
        runner = OpenAIAgentExecutor(server=self.server, agent=self.agent, samples_per_prompt=self.params.n)
        try:
            trajs = await runner.arun(texts, labels=labels)
        except (RuntimeError, ValueError) as err:
            raise reworded(err, f"--train.agent_func_path {str(self.path)!r}: {err}", RuntimeError) from err
        return _one_per_episode(trajs)


def _one_per_episode(trajs: Sequence[Trajectory]) -> list[Trajectory]:
    """The last trajectory of each (prompt, sample), in order, with the episode's segment count logged."""
    last: dict[tuple[int, int], Trajectory] = {}
    segments: dict[tuple[int, int], int] = {}
    for t in trajs:
        key = (t.prompt_index, t.sample_index)
        last[key] = t
        segments[key] = segments.get(key, 0) + 1
    out = []
    for key, t in last.items():
        t.extra_logs["agent_segments"] = float(segments[key])
        out.append(t)
    return out
