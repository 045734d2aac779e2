"""Plain data shared by every engine: sampling parameters in, generations out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["FinishReason", "Generation", "SamplingParams", "VersionSpan", "oldest_version"]

FinishReason = Literal["stop", "length", "abort"]
"""``stop``: the sample ended with EOS or a stop token (the token is included in ``token_ids``);
``length``: it hit ``max_new_tokens`` or the engine's maximum length; ``abort``: the engine dropped it."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample. The same object drives the vLLM and the transformers engine.

    Processing order (both engines): ``logits / temperature`` → keep the ``top_k`` largest → keep the
    smallest set whose probability reaches ``top_p`` → renormalise → sample. The returned logprobs are
    of that processed distribution, so a learner recomputing them must apply the same temperature
    (and the same top-k / top-p truncation when they are set).
    """

    temperature: float = 1.0
    """Softmax temperature; ``0`` means greedy (logprobs are then those of the raw distribution)."""
    top_p: float = 1.0
    """Nucleus mass in ``(0, 1]``; ``1`` disables it."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens; ``0`` disables it."""
    max_new_tokens: int = 64
    """Upper bound on generated tokens per sample (the stop token counts)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a sample besides the model's EOS. The stop token is kept in the output."""
    seed: int | None = None
    """``None``: fresh randomness. Otherwise sample ``j`` of prompt ``i`` is drawn reproducibly from
    ``seed`` (vLLM: per-request seed ``seed + i * n + j``, independent of batching; transformers:
    one generator for the call, so the same prompts in the same call give the same tokens)."""
    seed_per_sample: bool = True
    """With a ``seed``, vLLM engines seed each sample (as ``seed`` says). ``False``: the synchronous vLLM
    engine seeds its sampler once for the call instead, as the transformers engine does: the same prompts
    in the same call give the same tokens on an engine of the same settings whose prefix cache holds the
    same (vLLM's noise is drawn per step and batch row, so the tokens depend on how the call is
    scheduled). It spares vLLM drawing each seeded request's noise one request at a time. It needs the
    engine's worker in the engine's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker); the
    caller's random state is left as it was. The asynchronous engine, whose calls overlap, refuses it.
    vLLM's V2 model runner (GPU, with Triton) draws seeded requests' noise in one kernel: there each sample
    stays seeded."""
    n: int = 1
    """Samples per prompt."""
    ignore_eos: bool = False
    """Keep generating past EOS (stop tokens still stop). For benchmarks with fixed lengths."""
    logprobs: bool = True
    """Return each sampled token's logprob. ``False``: every ``Generation.logprobs`` entry is NaN, and the
    vLLM engines skip that work (vLLM's per-token log-prob gathering and bookkeeping; the transformers
    engine, whose logits processor samples, computes them anyway)."""
    extra: dict = field(default_factory=dict, compare=False)
    """Backend-specific extras passed through unchanged (e.g. vLLM ``SamplingParams`` fields)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class VersionSpan:
    """Tokens ``[start, end)`` of a sequence were sampled by the weights labelled ``version``."""

    version: int
    start: int
    end: int


def oldest_version(spans: tuple[VersionSpan, ...] | list[VersionSpan]) -> int | None:
    """The oldest weight version that sampled any of the tokens (``None``: no spans, no labels)."""
    return min((s.version for s in spans), default=None)


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One sample: the generated tokens only (not the prompt) and the logprob of each."""

    token_ids: list[int]
    logprobs: list[float]
    """``logprobs[t]`` is ``log p(token_ids[t] | prefix)`` under the processed sampling distribution (NaN when
    the sampling params asked for none)."""
    finish_reason: FinishReason
    weight_versions: tuple[VersionSpan, ...] = ()
    """Which weights sampled which tokens, as spans over ``token_ids``: one span unless a weight update
    landed mid-generation (partial rollout); empty when the engine labels no versions."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"Generation has {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")
