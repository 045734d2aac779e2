"""Engines as Ray actors, and a client that spreads one batch over several of them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rlhf_rollout.backends import RolloutBackend, rollout_backend
from rlhf_rollout.cores import bind_sharded_workers, pin_to_cores
from rlhf_rollout.engine import EngineCapabilities, WeightSyncReport
from rlhf_rollout.engine_faults import EngineFaults, EngineReplacer, engine_death
from rlhf_rollout.engine_setup import (
    actor_options,
    check_engine_counts,
    engine_arguments,
    on_gpus,
    resolve_bundle_indices,
)
from rlhf_rollout.types import Generation, SamplingParams

if TYPE_CHECKING:
    from ray import ObjectRef

__all__ = ["EngineActor", "EngineClient", "Shard", "create_engines", "engines_started"]


class EngineActor:
    """Holds one engine inside a Ray actor. Methods are typed and keyword-only. ``cpu_cores``: pin the
    engine to these cores (:func:`pin_to_cores`)."""

    def __init__(
        self, *, backend: RolloutBackend | str, engine_kwargs: dict[str, Any], cpu_cores: Sequence[int] = ()
    ) -> None:
        if cpu_cores:
            pin_to_cores(cpu_cores)
        bind_sharded_workers(engine_kwargs)
        self.engine = (rollout_backend(backend) if isinstance(backend, str) else backend).make_engine(
            engine_kwargs
        )

    def generate(self, *, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        return self.engine.generate(prompts, params)

    def capabilities(self) -> EngineCapabilities:
        return self.engine.capabilities

    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def init_weight_sync(
        self,
        *,
        transport: str,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        timeout_s: float = 60.0,
    ) -> None:
        self.engine.init_weight_sync(
            transport=transport,
            master_addr=master_addr,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            timeout_s=timeout_s,
        )

    def receive_weights(self, *, timeout_s: float | None = None) -> WeightSyncReport:
        return self.engine.receive_weights(timeout_s=timeout_s)

    def close_weight_sync(self) -> None:
        self.engine.close_weight_sync()

    def reload_weights_from_path(self, *, path: str) -> None:
        """vLLM only: load a safetensors folder into the running engine (prefix cache reset)."""
        self.engine.reload_weights_from_path(path=path)

    def load_weights(self, *, named_tensors: list[tuple[str, Any]]) -> int:
        out = self.engine.load_weights(named_tensors)
        self.engine.reset_prefix_cache()
        return out

    def sleep(self, *, level: int = 1) -> None:
        self.engine.sleep(level=level)

    def wake_up(self, *, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags=tags)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


def create_engines(
    *,
    num_engines: int,
    backend: str,
    engine_kwargs: dict[str, Any],
    tensor_parallel_size: int = 1,
    placement_group: Any = None,
    bundle_indices: Sequence[int] | None = None,
    num_cpus_per_engine: float = 1.0,
    num_gpus_per_engine: float = 0.0,
    env_vars: dict[str, str] | None = None,
    start_timeout_s: float = 1800.0,
    asynchronous: bool = False,
    cpu_cores: Sequence[Sequence[int]] = (),
    wait: bool = True,
) -> list[Any]:
    """Start ``num_engines`` :class:`EngineActor` s (``asynchronous``: :class:`AsyncEngineActor` s over
    vLLM's ``AsyncLLM``, which serve pauses and weight updates while generating); returns their handles,
    ready (start-up errors raised, within ``start_timeout_s``), or with ``wait=False`` at once, while they
    start (the caller's start-up overlaps theirs; wait for :func:`engines_started` before using them).

    Placement: with ``placement_group``, engine ``i`` takes the ``tensor_parallel_size`` bundles
    ``bundle_indices[i*tp : (i+1)*tp]`` (default ``range(num_engines * tp)``); the actor sits on the
    first and, for ``tensor_parallel_size > 1`` on GPUs, vLLM's Ray executor places its workers on all of
    them (``VLLM_RAY_BUNDLE_INDICES``; on CPU its workers are the actor's child processes). Each actor
    asks for ``num_cpus_per_engine`` CPUs and ``num_gpus_per_engine`` GPUs (its first worker's, tp 1).

    ``env_vars`` go into every actor's ``runtime_env`` (e.g. ``VLLM_CPU_KVCACHE_SPACE``, ``OMP_NUM_THREADS``:
    a CPU vLLM engine's torch threads, by default ``num_cpus_per_engine`` rounded). ``cpu_cores``: per
    engine, the cores of its node it is bound to (:func:`pin_to_cores`)."""
    import ray

    tp = tensor_parallel_size
    check_engine_counts(num_engines=num_engines, backend=backend, tp=tp, cpu_cores=cpu_cores)
    bundle_indices = resolve_bundle_indices(
        num_engines=num_engines, tp=tp, placement_group=placement_group, bundle_indices=bundle_indices
    )
    actor_cls = ray.remote(_actor_class(backend, asynchronous=asynchronous))
    chosen = rollout_backend(backend)  # the object, not its name: a backend registered here reaches the actor
    gpu = on_gpus(placement_group, bundle_indices, num_gpus_per_engine)
    kwargs = engine_arguments(backend=backend, engine_kwargs=engine_kwargs, tp=tp, gpu=gpu)
    handles = []
    for i in range(num_engines):
        options = actor_options(
            backend=backend,
            tp=tp,
            num_cpus=num_cpus_per_engine,
            num_gpus=num_gpus_per_engine,
            env_vars=env_vars,
            placement_group=placement_group,
            bundles=None if bundle_indices is None else bundle_indices[i * tp : (i + 1) * tp],
        )
        cores = list(cpu_cores[i]) if cpu_cores else []
        handles.append(
            actor_cls.options(**options).remote(backend=chosen, engine_kwargs=kwargs, cpu_cores=cores)
        )
    if wait:
        ray.get(engines_started(handles), timeout=start_timeout_s)
    return handles


def _actor_class(backend: str, *, asynchronous: bool) -> type:
    """:class:`AsyncEngineActor` for an asynchronous engine (refused for a backend without one), else
    :class:`EngineActor`."""
    from rlhf_rollout.async_vllm_engine import AsyncEngineActor

    if asynchronous and not rollout_backend(backend).capabilities.asynchronous:
        raise ValueError(f"asynchronous: the {backend} rollout backend has no asynchronous engine")
    return AsyncEngineActor if asynchronous else EngineActor


def engines_started(handles: Sequence[Any]) -> list[Any]:
    """One object ref per engine of :func:`create_engines`, ready once that engine has started (its
    ``max_model_len``), or failing with its start-up error."""
    return [h.max_model_len.remote() for h in handles]


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
        self._replacing = threading.Lock()
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
                rows = [list(p) for p in prompts[lo:hi]]
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

        async def one(shard: Shard) -> list[list[Generation]]:
            while True:
                handle, ref = self.submit(shard)
                try:
                    return await ref
                except Exception as err:
                    await asyncio.to_thread(self.replace_dead, shard.engine, handle, err, since=started)

        shards = await asyncio.wait_for(
            asyncio.gather(*(one(s) for s in self.shards(prompts, params))), timeout=self.timeout_s
        )
        return [g for shard in shards for g in shard]

    def replace_dead(
        self, index: int, handle: Any, err: BaseException, *, since: float, pause_others: bool = True
    ) -> None:
        """Engine ``index`` (``handle``) failed a call with ``err``: when that is its death and a replacement
        is left, a new engine takes its place with the current weights (the others, when they pause,
        paused meanwhile: they keep their requests); else ``err`` is raised. A call that finds the engine
        already replaced (by a concurrent call) returns at once, to be repeated on the new one."""
        if not engine_death(err):
            raise err
        with self._replacing:
            if self.engines[index] is not handle:
                return
            if self.replacer is None or self.faults.restarts >= self.max_replacements:
                raise err
            self.engines[index] = self.replacer.start(index, err)
            others = [e for i, e in enumerate(self.engines) if i != index]
            pause = pause_others and self.pausable and bool(others)
            if pause:
                self._each(lambda e: e.pause.remote(mode="keep"), among=others)
            try:
                self.replacer.load_weights()
            finally:
                if pause:
                    self._each(lambda e: e.resume.remote(), among=others)
            self.faults.restarts += 1
            self.faults.seconds_lost += time.monotonic() - since

    def _each(
        self, call: Callable[[Any], Any], *, among: Sequence[Any] | None = None, pausing: bool = False
    ) -> list[Any]:
        """``call(engine)`` on every engine (or ``among`` them) at once, then each result; an engine that
        died meanwhile is replaced (:meth:`replace_dead`) and the call repeated on its successor.
        ``pausing``: the call pauses or resumes the engines (the others are left as it leaves them)."""
        import ray

        started = time.monotonic()
        handles = list(self.engines if among is None else among)
        refs = [call(h) for h in handles]
        out = []
        for handle, ref in zip(handles, refs, strict=True):
            while True:
                try:
                    out.append(ray.get(ref, timeout=self.timeout_s))
                    break
                except Exception as err:
                    if handle not in self.engines:
                        raise
                    index = self.engines.index(handle)
                    self.replace_dead(index, handle, err, since=started, pause_others=not pausing)
                    handle = self.engines[index]
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
        self, *, transport: str, master_addr: str, master_port: int, timeout_s: float = 60.0
    ) -> list[ObjectRef[None]]:
        """Start every engine joining one sync group (sender = rank 0; engine ``i``'s workers take
        ranks ``1 + i * tp ...``). Returns object refs; ``ray.get`` them after the sender joined."""
        world_size = 1 + len(self.engines) * self.tensor_parallel_size
        return [
            e.init_weight_sync.remote(
                transport=transport,
                master_addr=master_addr,
                master_port=master_port,
                rank_offset=1 + i * self.tensor_parallel_size,
                world_size=world_size,
                timeout_s=timeout_s,
            )
            for i, e in enumerate(self.engines)
        ]

    def receive_weights(self, *, timeout_s: float | None = None) -> list[ObjectRef[WeightSyncReport]]:
        """Start one receive on every engine (each resets its prefix cache after loading); returns one
        ref per engine, to that engine's report."""
        return [e.receive_weights.remote(timeout_s=timeout_s) for e in self.engines]

    def close_weight_sync(self) -> None:
        import ray

        ray.get([e.close_weight_sync.remote() for e in self.engines], timeout=self.timeout_s)
