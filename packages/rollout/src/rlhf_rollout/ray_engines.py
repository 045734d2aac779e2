"""Engines as Ray actors (the client that spreads one batch over several of them:
:mod:`rlhf_rollout.engine_client`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlhf_rollout.backends import RolloutBackend, rollout_backend
from rlhf_rollout.cores import bind_sharded_workers, pin_to_cores
from rlhf_rollout.engine import EngineCapabilities, WeightSyncReport
from rlhf_rollout.engine_client import EngineClient, Shard
from rlhf_rollout.engine_setup import (
    actor_options,
    check_engine_counts,
    engine_arguments,
    on_gpus,
    resolve_bundle_indices,
)
from rlhf_rollout.types import Generation, SamplingParams

if TYPE_CHECKING:
    pass

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
