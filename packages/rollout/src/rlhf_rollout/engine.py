"""The engine protocol every backend implements, and what each backend can and cannot do."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict, runtime_checkable

from rlhf_rollout.types import Generation, SamplingParams

__all__ = [
    "EngineCapabilities",
    "RolloutEngine",
    "TokenGenerator",
    "UnsupportedOperationError",
    "WeightSyncRPC",
    "WeightSyncReport",
    "check_prompts",
]


class UnsupportedOperationError(NotImplementedError):
    """The backend cannot do this (e.g. sleep mode on vLLM's CPU backend). Never a silent no-op."""


@dataclass(frozen=True, kw_only=True)
class EngineCapabilities:
    """What an engine supports; read it before relying on an optional feature."""

    backend: str
    """``vllm``, ``vllm-cpu`` or ``transformers``."""
    sleep: bool
    """``sleep()`` / ``wake_up()`` release and restore memory (GPU vLLM with ``enable_sleep_mode``)."""
    prefix_cache: bool
    """``reset_prefix_cache()`` has something to reset (otherwise it is a documented no-op)."""
    weight_sync_extension: bool
    """``init_weight_sync`` / ``receive_weights`` / ``close_weight_sync`` reach a worker extension."""
    load_weights: bool
    """``load_weights(named_tensors)`` loads tensors handed over in this process."""
    notes: str = ""
    """Human-readable reasons for the ``False`` entries."""


@runtime_checkable
class TokenGenerator(Protocol):
    """What an agent executor needs of an engine: a ``RolloutEngine``, or an ``EngineClient`` over
    engines on Ray (which also offers ``agenerate``, awaited when present)."""

    @property
    def max_model_len(self) -> int: ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Generation]]: ...


@runtime_checkable
class RolloutEngine(Protocol):
    """Token ids in; per prompt, ``params.n`` :class:`Generation` s out, in prompt order.

    Weight-update entry points: ``load_weights(named_tensors)`` where the tensors are at hand, and the
    worker-extension trio ``init_weight_sync`` / ``receive_weights`` / ``close_weight_sync`` (vLLM).
    Every update must be followed by ``reset_prefix_cache()`` (engines do it themselves).
    Operations a backend lacks raise :class:`UnsupportedOperationError`; see ``capabilities``.
    """

    @property
    def capabilities(self) -> EngineCapabilities: ...

    @property
    def max_model_len(self) -> int: ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Generation]]: ...

    def sleep(self, *, level: int = 1) -> None: ...

    def wake_up(self, *, tags: list[str] | None = None) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def shutdown(self) -> None: ...


class WeightSyncReport(TypedDict):
    """What one ``receive_weights`` loaded: rlhf-weightsync's ``SyncStats`` as a plain dict (its
    ``WeightSyncReport``, the same keys; this package does not import it). A dict of builtins crosses
    vLLM's ``collective_rpc`` and Ray unchanged."""

    version: int
    """Weights version of the sync (the sender's)."""
    num_tensors: int
    num_names: int
    num_buckets: int
    num_bytes: int
    seconds: float
    """Wall time of the receive (for an engine with several workers: the slowest worker's)."""


class WeightSyncRPC(Protocol):
    """The weight-sync worker-extension calls, defined once: what rlhf-weightsync's
    ``WeightSyncWorkerExtension`` implements in each engine worker, and what ``VLLMEngine``,
    ``TransformersEngine`` and the Ray ``EngineActor`` forward to it with the same parameters and
    return type (a test compares their signatures with this one)."""

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
        """Join the sync group as rank ``rank_offset`` (+ the worker's tensor-parallel rank) of
        ``world_size``; blocks until the sender and every receiver joined."""
        ...

    def receive_weights(self, *, timeout_s: float | None = None) -> WeightSyncReport:
        """Receive one sync into the model (then the prefix cache is reset); returns its report (an
        engine whose workers each received it: one report, with the slowest worker's ``seconds``)."""
        ...

    def close_weight_sync(self) -> None: ...


def check_prompts(prompts: Sequence[Sequence[int]], *, max_model_len: int, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the first bad prompt: empty, too long, or with out-of-range ids."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) >= max_model_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; the engine's max_model_len is {max_model_len}, "
                "which leaves no room to generate"
            )
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt {i} has token id {bad} outside the vocabulary [0, {vocab_size})")
