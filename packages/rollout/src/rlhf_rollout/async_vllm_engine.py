"""vLLM's ``AsyncLLM`` behind the engine protocol, with coroutines: weight updates, pauses and version
labels are accepted while requests generate (what asynchronous training and partial rollout need)."""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from rlhf_rollout.cores import bind_all_threads, bind_sharded_workers, pin_to_cores
from rlhf_rollout.engine import (
    EngineCapabilities,
    UnsupportedOperationError,
    WeightSyncReport,
    check_prompts,
)
from rlhf_rollout.types import Generation, SamplingParams
from rlhf_rollout.vllm_engine import (
    VLLMOptions,
    merge_worker_reports,
    to_generation,
    tokens_prompt,
    vllm_sampling_params,
)

__all__ = ["AsyncEngineActor", "AsyncVLLMEngine"]

PauseMode = Literal["keep", "wait", "abort"]


class AsyncVLLMEngine(VLLMOptions):
    """A ``vllm.v1.engine.async_llm.AsyncLLM`` (its engine core runs in a child process).

    Every method that talks to the engine is a coroutine, so one event loop can generate and, meanwhile,
    pause the engine at a token boundary (:meth:`pause`), load new weights (:meth:`receive_weights`, which
    labels the tokens sampled afterwards with the new version) and resume. Each :class:`Generation`
    carries ``weight_versions``: which version sampled which of its tokens. Options are those of
    :class:`~rlhf_rollout.vllm_engine.VLLMEngine`; sleep mode is GPU only, as there.
    """

    def _start(self, kwargs: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._ids = itertools.count()
        self._labelled = False  # the weights read at start-up are labelled version 0 on first use
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self._v2_runner = bool(getattr(self._llm.vllm_config, "use_v2_model_runner", False))
        return self._llm.model_config

    async def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Generation]]:
        """All prompts as concurrent requests; per prompt its ``params.n`` generations in sample order."""
        check_prompts(prompts, max_model_len=self._max_model_len, vocab_size=self._vocab_size)
        return list(await asyncio.gather(*(self._one(p, params, i) for i, p in enumerate(prompts))))

    async def _one(self, prompt: Sequence[int], params: SamplingParams, index: int) -> list[Generation]:
        final = None
        async for out in self._requests(prompt, params, index, final_only=True):
            final = out
        assert final is not None and final.finished
        return [to_generation(c) for c in sorted(final.outputs, key=lambda c: c.index)]

    async def stream(
        self, prompt: Sequence[int], params: SamplingParams, *, prompt_index: int = 0
    ) -> AsyncIterator[list[Generation]]:
        """One prompt's ``params.n`` generations so far, after every step of the engine (the last one
        yielded is final; weight-version spans are only on a finished sample). ``prompt_index`` places the
        prompt in a call for its seed (see :class:`~rlhf_rollout.types.SamplingParams`)."""
        latest: dict[int, Any] = {}  # vLLM streams each of the n samples on its own: keep each one's last
        async for out in self._requests(prompt, params, prompt_index, final_only=False):
            latest.update((c.index, c) for c in out.outputs)
            yield [_partial(latest[i]) for i in sorted(latest)]

    async def _requests(self, prompt: Sequence[int], params: SamplingParams, index: int, *, final_only: bool):
        check_prompts([prompt], max_model_len=self._max_model_len, vocab_size=self._vocab_size)
        if params.seed is not None and not params.seed_per_sample and not self._v2_runner:
            raise ValueError(
                "seed_per_sample=False: the asynchronous engine's calls overlap, so none can seed the "
                "sampler for itself; seed each sample (seed_per_sample=True)"
            )  # (vLLM's V2 model runner seeds each sample at no cost: it does so)
        if not self._labelled:
            await self._label(0)
        request = tokens_prompt(prompt)
        sampling = vllm_sampling_params(params, index, final_only=final_only)
        async for out in self._llm.generate(request, sampling, request_id=f"rlhf-{next(self._ids)}"):
            yield out

    # --- pausing: requests stay where they are; their KV is recomputed with the new weights ----------
    async def pause(self, *, mode: PauseMode = "keep") -> None:
        """Stop scheduling at the next token boundary. ``keep`` freezes running requests (they go on
        after :meth:`resume`, their caches dropped so the rest is computed with the weights then loaded);
        ``wait`` lets them finish first; ``abort`` ends them (finish reason ``abort``)."""
        await self._llm.pause_generation(mode=mode, clear_cache=True)

    async def resume(self) -> None:
        await self._llm.resume_generation()

    async def is_paused(self) -> bool:
        return bool(await self._llm.is_paused())

    # --- weight updates: forwarded by name to the worker extension -------------------------------------
    async def _rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float | None = None) -> list[Any]:
        if self._extension is None:
            raise UnsupportedOperationError(
                f"{method}: this engine was built without worker_extension_cls, so its workers have no "
                f"{method!r} method"
            )
        return await self._llm.collective_rpc(method, timeout=timeout_s, kwargs=kwargs)

    async def init_weight_sync(
        self,
        *,
        transport: str,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        timeout_s: float = 60.0,
    ) -> None:
        kwargs = dict(
            transport=transport,
            master_addr=master_addr,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            timeout_s=timeout_s,
        )
        await self._rpc("init_weight_sync", kwargs)

    async def receive_weights(self, *, timeout_s: float | None = None) -> WeightSyncReport:
        """Receive one sync on every worker, drop the caches computed with the old weights, and label the
        tokens sampled from now on with the sync's version."""
        reports: list[WeightSyncReport] = await self._rpc("receive_weights", dict(timeout_s=timeout_s))
        report = merge_worker_reports(reports)
        await self.reset_prefix_cache()
        await self._label(report["version"])
        return report

    async def _label(self, version: int) -> None:
        """Tokens sampled from now on carry ``version`` in their spans."""
        await self._llm.update_weight_version(str(version))
        self._labelled = True

    async def close_weight_sync(self) -> None:
        await self._rpc("close_weight_sync", {})

    async def weight_version(self) -> int | None:
        label = await self._llm.get_weight_version()
        return int(label) if label is not None and str(label).lstrip("-").isdigit() else None

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (and image embedding). vLLM refuses while requests run (their blocks are in use): then the
        running requests are reset too (their caches are recomputed when they are next scheduled)."""
        if not await self._llm.reset_prefix_cache() and not await self._llm.reset_prefix_cache(
            reset_running_requests=True
        ):
            raise RuntimeError("vLLM refused to reset its prefix cache, even resetting running requests")
        if self._multimodal:  # image embeddings of the old weights (the running requests' are recomputed)
            await self._llm.reset_encoder_cache()

    async def sleep(self, *, level: int = 1) -> None:
        if not self.capabilities.sleep:
            raise UnsupportedOperationError(f"sleep: {self.capabilities.notes}")
        await self._llm.sleep(level=level)

    async def wake_up(self, *, tags: list[str] | None = None) -> None:
        if not self.capabilities.sleep:
            raise UnsupportedOperationError(f"wake_up: {self.capabilities.notes}")
        await self._llm.wake_up(tags=tags)

    def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()


def _partial(completion) -> Generation:
    """A completion as a :class:`Generation`; before it finished its finish reason reads ``length``."""
    if not completion.finish_reason:
        completion = copy.copy(completion)
        completion.finish_reason = "length"
    return to_generation(completion)


class AsyncEngineActor:
    """Holds one :class:`~rlhf_rollout.async_vllm_engine.AsyncVLLMEngine` in an async Ray actor: its
    methods are coroutines on one event loop, so a weight update, a pause or a version query is served
    while ``generate`` calls are still running (a synchronous actor would queue them behind)."""

    def __init__(self, *, backend: Any, engine_kwargs: dict[str, Any], cpu_cores: Sequence[int] = ()) -> None:
        """``backend``: a ``RolloutBackend`` or its registered name."""
        allowed = os.sched_getaffinity(0)
        if cpu_cores:
            pin_to_cores(cpu_cores)  # the engine core process it starts inherits the binding
        bind_sharded_workers(engine_kwargs)
        from rlhf_rollout.backends import rollout_backend

        chosen = rollout_backend(backend) if isinstance(backend, str) else backend
        self.engine = chosen.make_async_engine(engine_kwargs)
        if cpu_cores:  # the front end (requests in, outputs out, its ZMQ threads) on any core: bound beside
            bind_all_threads(allowed)  # its engine core, it took a sixth of that core at 0.4M parameters

    async def generate(self, *, prompts: list[list[int]], params: SamplingParams) -> list[list[Generation]]:
        return await self.engine.generate(prompts, params)

    async def capabilities(self) -> EngineCapabilities:
        return self.engine.capabilities

    async def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def init_weight_sync(
        self,
        *,
        transport: str,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        timeout_s: float = 60.0,
    ) -> None:
        await self.engine.init_weight_sync(
            transport=transport,
            master_addr=master_addr,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            timeout_s=timeout_s,
        )

    async def receive_weights(self, *, timeout_s: float | None = None) -> WeightSyncReport:
        return await self.engine.receive_weights(timeout_s=timeout_s)

    async def close_weight_sync(self) -> None:
        await self.engine.close_weight_sync()

    async def pause(self, *, mode: str = "keep") -> None:
        await self.engine.pause(mode=mode)  # type: ignore[arg-type]

    async def resume(self) -> None:
        await self.engine.resume()

    async def weight_version(self) -> int | None:
        return await self.engine.weight_version()

    async def sleep(self, *, level: int = 1) -> None:
        await self.engine.sleep(level=level)

    async def wake_up(self, *, tags: list[str] | None = None) -> None:
        await self.engine.wake_up(tags=tags)

    async def reset_prefix_cache(self) -> None:
        await self.engine.reset_prefix_cache()

    async def shutdown(self) -> None:
        self.engine.shutdown()
