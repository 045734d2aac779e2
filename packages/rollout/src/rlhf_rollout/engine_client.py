"""A client that spreads one batch over several engine actors, and replaces an engine that dies."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rlhf_rollout.engine import EngineCapabilities, WeightSyncReport
from rlhf_rollout.engine_faults import EngineFaults, EngineReplacer, engine_death
from rlhf_rollout.images import ImagePrompt
from rlhf_rollout.types import Generation, SamplingParams

if TYPE_CHECKING:
    from ray import ObjectRef

__all__ = ["EngineClient", "Shard"]


@dataclass(frozen=True)
class Shard:
    """The part of a generation call one engine serves."""

    engine: int
    """The engine's index in :attr:`EngineClient.engines`."""
    prompts: list[list[int]]
    params: SamplingParams


class EngineClient:
    """One front for several engine actors: a batch is cut into contiguous shards, one per engine.

    ``generate`` blocks; ``agenerate`` is a coroutine (Ray object refs are awaitable), so an executor
    can score finished shards while others are still generating. With a fixed ``params.seed`` the
    shard starting at prompt ``s`` gets seed ``seed + s * n``, so vLLM's per-request seeds
    (``seed + i * n + j``) do not depend on how the batch was split.

    With a ``replacer``, an engine that dies (:func:`engine_death`) is replaced, up to
    ``max_replacements`` times, and what it was doing is done again on its successor: a shard is generated
    again from its prompts with its seed, a pause or reset is repeated. ``faults`` says what it cost.
    """

    def __init__(
        self,
        engines: Sequence[Any],
        *,
        tensor_parallel_size: int = 1,
        timeout_s: float = 1800.0,
        replacer: EngineReplacer | None = None,
        max_replacements: int = 0,
    ) -> None:
        if not engines:
            raise ValueError("EngineClient needs at least one engine actor")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.engines = list(engines)
        self.tensor_parallel_size = tensor_parallel_size
        self.timeout_s = timeout_s
        """Bound on every wait for the engines (a generation call, a reset, leaving a sync group)."""
        self.replacer, self.max_replacements = replacer, max_replacements
        self.faults = EngineFaults()
        self._replacing = replacer.lock if replacer is not None else threading.RLock()
        self._max_model_len: int | None = None
        self._turn = 0

    @property
    def max_model_len(self) -> int:
        if self._max_model_len is None:
            self._max_model_len = min(self._each(lambda e: e.max_model_len.remote()))
        return self._max_model_len

    @property
    def pausable(self) -> bool:
        """The engines pause at a token boundary (:class:`AsyncEngineActor`)."""
        return all(hasattr(e, "pause") for e in self.engines)

    def capabilities(self) -> list[EngineCapabilities]:
        return self._each(lambda e: e.capabilities.remote())

    def shards(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Shard]:
        """How a call is spread: one contiguous, non-empty shard per engine (a call smaller than the
        number of engines takes them in turn)."""
        k = len(self.engines)
        first = 0
        if len(prompts) < k:
            first, self._turn = self._turn % k, self._turn + 1
        bounds = [len(prompts) * e // k for e in range(k + 1)]
        out = []
        for e in range(k):
            lo, hi = bounds[e], bounds[e + 1]
            if lo < hi:
                seeded = params if params.seed is None else replace(params, seed=params.seed + lo * params.n)
                rows = [p if isinstance(p, ImagePrompt) else list(p) for p in prompts[lo:hi]]
                out.append(Shard(engine=(first + e) % k, prompts=rows, params=seeded))
        return out

    def submit(self, shard: Shard) -> tuple[Any, ObjectRef[list[list[Generation]]]]:
        """Start ``shard`` on its engine; returns ``(the engine's handle, the call's ref)``."""
        handle = self.engines[shard.engine]
        return handle, handle.generate.remote(prompts=shard.prompts, params=shard.params)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        import ray

        started = time.monotonic()
        calls = [(shard, *self.submit(shard)) for shard in self.shards(prompts, params)]
        out: list[list[Generation]] = []
        for shard, handle, ref in calls:
            while True:
                try:
                    out.extend(ray.get(ref, timeout=self.timeout_s))
                    break
                except Exception as err:
                    self.replace_dead(shard.engine, handle, err, since=started)
                    handle, ref = self.submit(shard)
        return out

    async def agenerate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Generation]]:
        started = time.monotonic()

        async def attempt(ref: Any) -> list[list[Generation]]:
            return await ref

        async def one(shard: Shard) -> list[list[Generation]]:
            while True:  # each attempt within the time limit (a replacement in between has its own)
                handle, ref = self.submit(shard)
                try:
                    return await asyncio.wait_for(attempt(ref), timeout=self.timeout_s)
                except Exception as err:
                    await asyncio.to_thread(self.replace_dead, shard.engine, handle, err, since=started)

        shards = await asyncio.gather(*(one(s) for s in self.shards(prompts, params)))
        return [g for shard in shards for g in shard]

    def replace_dead(
        self, index: int, handle: Any, err: BaseException, *, since: float, pause_others: bool = True
    ) -> None:
        """Engine ``index`` (``handle``) failed a call with ``err``: when that is its death and a replacement
        is left, a new engine takes its place with the current weights before any call reaches it (the
        others, when they pause, paused meanwhile: they keep their requests); else ``err`` is raised. A
        call that finds the engine already replaced (by a concurrent call) returns at once, to be repeated
        on the new one."""
        import ray

        if not engine_death(err):
            raise err
        with self._replacing:
            if self.engines[index] is not handle:
                return
            if self.replacer is None or self.faults.restarts >= self.max_replacements:
                raise err
            self.faults.restarts += 1
            with contextlib.suppress(Exception):  # its bundle freed now, not when Ray notices
                ray.kill(handle, no_restart=True)
            new = self.replacer.start(index, err)
            engines = [new if i == index else e for i, e in enumerate(self.engines)]
            others = [i for i in range(len(engines)) if i != index]
            pause = pause_others and self.pausable and bool(others)
            if pause:
                self._each(lambda e: e.pause.remote(mode="keep"), indices=others)
            try:
                self.replacer.load_weights(engines)
            finally:
                if pause:
                    self._each(lambda e: e.resume.remote(), indices=others)
            self.engines[index] = new
            self.faults.seconds_lost += time.monotonic() - since

    def _each(
        self, call: Callable[[Any], Any], *, indices: Sequence[int] | None = None, pausing: bool = False
    ) -> list[Any]:
        """``call(engine)`` on every engine (or those at ``indices``) at once, then each result; an engine
        that died meanwhile is replaced (:meth:`replace_dead`) and the call repeated on its successor.
        ``pausing``: the call pauses or resumes the engines (the others are left as it leaves them)."""
        import ray

        started = time.monotonic()
        chosen = range(len(self.engines)) if indices is None else indices
        calls = [(i, self.engines[i]) for i in chosen]
        refs = [call(h) for _, h in calls]
        out = []
        for (i, handle), ref in zip(calls, refs, strict=True):
            while True:
                try:
                    out.append(ray.get(ref, timeout=self.timeout_s))
                    break
                except Exception as err:
                    self.replace_dead(i, handle, err, since=started, pause_others=not pausing)
                    handle = self.engines[i]
                    ref = call(handle)
        return out

    def reset_prefix_cache(self) -> None:
        self._each(lambda e: e.reset_prefix_cache.remote())

    def pause(self, *, mode: str = "keep") -> None:
        """Pause every engine at a token boundary (:class:`AsyncEngineActor` only): ``keep`` freezes the
        running requests until :meth:`resume`."""
        self._each(lambda e: e.pause.remote(mode=mode), pausing=True)

    def resume(self) -> None:
        self._each(lambda e: e.resume.remote(), pausing=True)

    def sleep(self, *, level: int = 1) -> None:
        """Release every engine's memory (GPU vLLM with sleep mode; see ``capabilities``): level 1 keeps
        the weights in host memory, level 2 drops them (push weights after waking)."""
        import ray

        ray.get([e.sleep.remote(level=level) for e in self.engines], timeout=self.timeout_s)

    def wake_up(self, *, tags: list[str] | None = None) -> None:
        import ray

        ray.get([e.wake_up.remote(tags=tags) for e in self.engines], timeout=self.timeout_s)

    # --- weight sync: non-blocking, because the sender must join while the engines wait -------------
    def init_weight_sync(
        self,
        *,
        transport: str,
        master_addr: str,
        master_port: int,
        timeout_s: float = 60.0,
        engines: Sequence[Any] | None = None,
    ) -> list[ObjectRef[None]]:
        """Start every engine (or ``engines``: the client's with a replacement in) joining one sync group
        (sender = rank 0; engine ``i``'s workers take ranks ``1 + i * tp ...``). Returns object refs;
        ``ray.get`` them after the sender joined."""
        engines = self.engines if engines is None else engines
        world_size = 1 + len(engines) * self.tensor_parallel_size
        return [
            e.init_weight_sync.remote(
                transport=transport,
                master_addr=master_addr,
                master_port=master_port,
                rank_offset=1 + i * self.tensor_parallel_size,
                world_size=world_size,
                timeout_s=timeout_s,
            )
            for i, e in enumerate(engines)
        ]

    def receive_weights(
        self, *, timeout_s: float | None = None, engines: Sequence[Any] | None = None
    ) -> list[ObjectRef[WeightSyncReport]]:
        """Start one receive on every engine (or ``engines``; each resets its prefix cache after loading);
        returns one ref per engine, to that engine's report."""
        return [
            e.receive_weights.remote(timeout_s=timeout_s)
            for e in (self.engines if engines is None else engines)
        ]

    def close_weight_sync(self) -> None:
        import ray

        ray.get([e.close_weight_sync.remote() for e in self.engines], timeout=self.timeout_s)
