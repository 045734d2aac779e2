"""Reward sources: a ``reward_func`` from a user's .py file, checked output, one result type."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

__all__ = [
    "RewardFunction",
    "RewardResult",
    "RewardSource",
    "import_python_file",
    "load_reward_func",
    "normalize_reward_output",
]


@dataclass(frozen=True, kw_only=True)
class RewardResult:
    """Per-sample rewards, scores and logged extras (each extra list has one value per sample)."""

    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]] = field(default_factory=dict)


class RewardSource(Protocol):
    """Anything that scores decoded samples: :class:`RewardFunction`, ``RemoteReward``."""

    async def ascore(
        self, *, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]
    ) -> RewardResult: ...


def _as_floats(value: Any, *, what: str, source: str, n: int) -> list[float]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (int, float)):
        raise ValueError(f"{source}: {what} is a single number; expected one per sample ({n})")
    try:
        out = [float(v) for v in value]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {what} must be a list of numbers, got {type(value).__name__}") from err
    if len(out) != n:
        raise ValueError(f"{source}: {what} has {len(out)} values for {n} samples")
    for i, v in enumerate(out):
        if not math.isfinite(v):
            raise ValueError(f"{source}: {what} of sample {i} is {v} (not finite)")
    return out


def normalize_reward_output(output: Any, *, n: int, source: str) -> RewardResult:
    """Accept ``rewards`` (list / tensor) or a dict with ``rewards`` and optional ``scores`` and
    ``extra_logs`` (OpenRLHF's shape); check lengths and finiteness, naming ``source`` and the sample."""
    if isinstance(output, dict):
        if "rewards" not in output:
            raise ValueError(f"{source}: returned a dict without 'rewards' (keys: {sorted(output)})")
        rewards = _as_floats(output["rewards"], what="rewards", source=source, n=n)
        scores = output.get("scores")
        scores = rewards if scores is None else _as_floats(scores, what="scores", source=source, n=n)
        extra = {
            str(k): _as_floats(v, what=f"extra_logs[{k!r}]", source=source, n=n)
            for k, v in (output.get("extra_logs") or {}).items()
        }
        return RewardResult(rewards=rewards, scores=scores, extra_logs=extra)
    rewards = _as_floats(output, what="rewards", source=source, n=n)
    return RewardResult(rewards=rewards, scores=rewards)


def import_python_file(path: str | Path, *, what: str) -> ModuleType:
    """Execute the Python file at ``path`` as a module (only for files you trust); errors name ``what``
    and the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_rlhf_user_{abs(hash(str(path.resolve())))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what} {str(path)!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise RuntimeError(f"importing {what} {str(path)!r} failed: {err!r}") from err
    return module


def load_reward_func(path: str | Path) -> Callable[..., Any]:
    """Import ``reward_func`` from the Python file at ``path``; errors name the file."""
    module = import_python_file(path, what="reward function file")
    func = getattr(module, "reward_func", None)
    if func is None:
        raise ValueError(f"reward function file {str(path)!r} defines no 'reward_func'")
    if not callable(func):
        raise ValueError(f"'reward_func' in {str(path)!r} is not callable")
    return func


class RewardFunction:
    """``reward_func(queries, prompts, labels, **kwargs)`` (sync or async) as a reward source.

    ``queries`` are the decoded full texts (prompt + response), ``prompts`` the decoded prompts. The
    function returns rewards, or ``{"rewards": ..., "scores": ..., "extra_logs": {...}}``.
    """

    def __init__(
        self, func: Callable[..., Any], *, name: str | None = None, kwargs: dict[str, Any] | None = None
    ):
        self.func = func
        self.name = name or getattr(func, "__qualname__", repr(func))
        self.kwargs = dict(kwargs or {})

    @classmethod
    def from_file(cls, path: str | Path, *, kwargs: dict[str, Any] | None = None) -> RewardFunction:
        return cls(load_reward_func(path), name=f"reward_func in {str(path)!r}", kwargs=kwargs)

    async def ascore(
        self, *, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any]
    ) -> RewardResult:
        args = (list(queries), list(prompts), list(labels))
        try:
            if inspect.iscoroutinefunction(self.func):
                out = await self.func(*args, **self.kwargs)
            else:
                out = await asyncio.to_thread(self.func, *args, **self.kwargs)
        except Exception as err:
            raise RuntimeError(f"{self.name} raised {err!r}") from err
        return normalize_reward_output(out, n=len(queries), source=self.name)
