"""Reward sources: a ``reward_func`` from a user's .py file, checked output, one result type."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib.util
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from rlhf_rollout._calls import UserCodeError, named_call, user_frames

__all__ = [
    "RewardFunction",
    "RewardResult",
    "RewardSource",
    "check_call",
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
        self,
        *,
        queries: Sequence[str],
        prompts: Sequence[str],
        labels: Sequence[Any],
        images: Sequence[Sequence[Any]] | None = None,
    ) -> RewardResult:
        """``images``: each sample's prompt images (PIL), when the prompts have images."""
        ...


def _as_floats(value: Any, *, what: str, source: str, n: int) -> list[float]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (int, float)):
        raise ValueError(f"{source}: {what} is a single number; expected one per sample ({n})")
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{source}: {what} must be a list of numbers, got {type(value).__name__}")
    out = []
    for i, v in enumerate(value):
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise ValueError(f"{source}: {what} of sample {i} is {v!r:.60}, not a number") from None
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
    except SyntaxError as err:  # where, as an editor reads it, and the line itself
        text = (err.text or "").strip()
        where = f"{err.filename or path}:{err.lineno}" + (f":{err.offset}" if err.offset else "")
        raise RuntimeError(f"{what} {where}: {err.msg}" + (f": {text}" if text else "")) from None
    except Exception as err:  # their frames (their file and line), not ours
        message = f"importing {what} {str(path)!r} failed: {err!r}"
        raise UserCodeError(message, user_traceback=user_frames(err)) from err
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


def check_call(func: Callable[..., Any], name: str, call: str, n_args: int, kwargs: dict[str, Any]) -> None:
    """Refuse, when it is loaded, user code that cannot take the call it will get: ``n_args`` positional
    arguments and ``kwargs`` (``call`` says how it is called, for the one-line error)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call will tell
        return
    try:
        signature.bind(*([None] * n_args), **kwargs)
    except TypeError as err:
        raise ValueError(
            f"{name} is def {getattr(func, '__name__', 'func')}{signature}: it is called as {call} ({err})"
        ) from None


def accepts_keyword(func: Callable[..., Any], name: str) -> bool:
    """Whether ``func`` takes the keyword argument ``name`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY) for p in params
    )


class RewardFunction:
    """``reward_func(queries, prompts, labels, **kwargs)`` (sync or async) as a reward source.

    ``queries`` are the decoded full texts (prompt + response), ``prompts`` the decoded prompts. The
    function returns rewards, or ``{"rewards": ..., "scores": ..., "extra_logs": {...}}``. With
    ``timeout_s``, a call that takes longer fails with a ``TimeoutError`` naming the function (a sync
    function then runs in a daemon thread, which is abandoned, not stopped).
    """

    def __init__(
        self,
        func: Callable[..., Any],
        *,
        name: str | None = None,
        kwargs: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 (or None: no limit), got {timeout_s}")
        self.func = func
        self.name = name or getattr(func, "__qualname__", repr(func))
        self.kwargs = dict(kwargs or {})
        self.timeout_s = timeout_s
        check_call(func, self.name, "reward_func(queries, prompts, labels)", 3, self.kwargs)
        self.takes_images = accepts_keyword(func, "images")
        """Image prompts' samples pass ``images=`` (each sample's prompt images) when the function takes it."""

    @classmethod
    def from_file(
        cls, path: str | Path, *, kwargs: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> RewardFunction:
        return cls(
            load_reward_func(path), name=f"reward_func in {str(path)!r}", kwargs=kwargs, timeout_s=timeout_s
        )

    async def ascore(
        self,
        *,
        queries: Sequence[str],
        prompts: Sequence[str],
        labels: Sequence[Any],
        images: Sequence[Sequence[Any]] | None = None,
    ) -> RewardResult:
        extra = {"images": [list(i) for i in images]} if images is not None and self.takes_images else {}
        out = await named_call(
            self._call(list(queries), list(prompts), list(labels), **extra),
            timeout_s=self.timeout_s,
            timed_out=f"{self.name} did not return within {self.timeout_s} s ({len(queries)} samples)",
            failed=f"{self.name} raised",
        )
        return normalize_reward_output(out, n=len(queries), source=self.name)

    async def _call(self, *args: Any, **extra: Any) -> Any:
        kwargs = self.kwargs | extra
        if inspect.iscoroutinefunction(self.func):
            return await self.func(*args, **kwargs)
        if self.timeout_s is None:
            return await asyncio.to_thread(self.func, *args, **kwargs)
        # not the loop's executor: asyncio.run would wait at exit for a call abandoned by the timeout
        return await _in_daemon_thread(self.func, *args, **kwargs)


async def _in_daemon_thread(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` in a new daemon thread (the caller's context copied), awaited."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    context = contextvars.copy_context()

    def settle(value: Any, err: BaseException | None) -> None:
        if done.cancelled():
            return
        if err is not None:
            done.set_exception(err)
        else:
            done.set_result(value)

    def work() -> None:
        try:
            value, err = context.run(func, *args, **kwargs), None
        except BaseException as e:  # handed to the awaiting task
            value, err = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
            loop.call_soon_threadsafe(settle, value, err)

    threading.Thread(target=work, name=f"reward-{getattr(func, '__name__', 'func')}", daemon=True).start()
    return await done
