"""The rollout-backend seam: a backend's capabilities, settings, memory estimate, and the registry.

A backend in another package reaches every process through an entry point in the ``rlhf.rollout_backends``
group naming its module (which registers the backend when imported): a name not registered yet loads them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ROLLOUT_BACKENDS",
    "BackendCapabilities",
    "EngineMemory",
    "EngineSettings",
    "MemoryQuery",
    "RolloutBackend",
    "register_rollout_backend",
    "rollout_backend",
]

_GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class BackendCapabilities:
    """What a rollout backend can do; callers read these instead of its name."""

    tensor_parallel: bool
    """Shards one model over several workers (``tensor_parallel_size > 1``)."""
    asynchronous: bool
    """Has an asynchronous engine that pauses, takes weight updates and resumes while generating."""
    sleep: bool
    """Releases its GPU memory between phases (sleep / wake up) when it runs on GPUs."""
    gpu_weight_transports: bool
    """Receives weights on its GPUs (NCCL, CUDA IPC); otherwise over host memory (gloo, shm)."""
    seeded_calls: bool
    """Can seed its sampler once per call instead of per sample (reproducible only for one worker and
    calls that never overlap)."""
    logprobs: bool
    """Returns the log-prob of each sampled token."""
    compiles: bool
    """Compiles its model unless told to run eagerly."""


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """Backend-neutral settings of one rollout engine, built once by a recipe; each backend turns them
    into its engine's constructor arguments (:meth:`RolloutBackend.engine_kwargs`)."""

    model: str
    max_model_len: int
    dtype: str = "auto"
    """``auto``, ``float32`` or ``bfloat16``."""
    gpu: bool = False
    seed: int = 0
    prefix_caching: bool = True
    eager: bool = False
    """Run the model eagerly (a backend that compiles skips it)."""
    gpu_memory_utilization: float = 0.5
    sleep: bool = False
    """Colocated with learners on GPUs: release memory while they train (backends that can)."""
    kv_cache_gib: int = 1
    """KV-cache size per engine process on CPU (backends that pre-allocate one)."""


@dataclass(frozen=True, kw_only=True)
class MemoryQuery:
    """What a memory estimate for ``--dry-run`` knows of the engines."""

    params: int
    layers: int
    kv_dim: int
    """Key (= value) width per token and layer: kv heads x head dim."""
    tensor_parallel_size: int
    gpu: bool
    device_gib: float | None
    """One GPU's memory (None: unknown, or no GPU)."""
    gpu_memory_utilization: float
    max_model_len: int
    kv_cache_gib: int
    dtype_bytes: int = 2
    """Bytes per weight and per cached key or value in the engines' dtype (2: bf16, 4: fp32)."""


@dataclass(frozen=True, kw_only=True)
class EngineMemory:
    """One engine process's memory, as planned."""

    weights_gib: float
    kv_gib: float | None = None
    """The KV cache it holds (None: not sized: it grows with the batch, or takes what the device has left)."""
    kv_on_host: bool = False
    """The KV cache is pre-allocated in host memory (it must fit the node beside everything else)."""
    min_kv_gib: float | None = None
    """The least KV cache that holds one ``max_model_len`` sequence (refuse a plan below it)."""
    note: str = ""


class RolloutBackend:
    """One rollout backend: subclass it in the backend's own module and register an instance. The
    defaults suit a backend whose engine runs in its actor's process on one device."""

    name: str = ""
    capabilities: BackendCapabilities
    worker_extension: str = ""
    """Dotted path of the weight-sync worker extension its engines mix in (``worker_extension_cls``)."""

    def make_engine(self, engine_kwargs: dict[str, Any]) -> Any:
        """The engine (a ``RolloutEngine``), built inside its actor."""
        raise NotImplementedError

    def make_async_engine(self, engine_kwargs: dict[str, Any]) -> Any:
        """The asynchronous engine (``capabilities.asynchronous``)."""
        raise ValueError(f"the {self.name} rollout backend has no asynchronous engine")

    def engine_kwargs(self, settings: EngineSettings) -> dict[str, Any]:
        """The engine's constructor arguments for ``settings``."""
        raise NotImplementedError

    def process_env(self, settings: EngineSettings) -> dict[str, str]:
        """Environment variables its engine processes need (set in their actors' ``runtime_env``)."""
        return {}

    def shard_arguments(self, engine_kwargs: dict[str, Any], *, tp: int, gpu: bool) -> dict[str, Any]:
        """``engine_kwargs`` for an engine sharded over ``tp`` workers (a copy)."""
        return dict(engine_kwargs)

    def actor_resources(
        self, *, tp: int, num_cpus: float, num_gpus: float, bundles: Sequence[int] | None
    ) -> tuple[float, dict[str, str]]:
        """The GPUs its engine actor asks for and the environment it adds, given what the plan gives it."""
        return num_gpus, {}

    def memory(self, query: MemoryQuery) -> EngineMemory:
        """One engine process's memory: its dtype's weights split over its workers; a KV cache that grows."""
        return EngineMemory(weights_gib=query.params * query.dtype_bytes / query.tensor_parallel_size / _GIB)


ROLLOUT_BACKENDS: dict[str, RolloutBackend] = {}
"""Backend name -> its backend (filled as the backends' modules are imported)."""

PLUGIN_GROUP = "rlhf.rollout_backends"
"""Entry-point group of installed packages' rollout backends."""


def _load_plugins() -> list[str]:
    """Import the modules that installed packages name under ``rlhf.rollout_backends``; one line for each
    that fails to import (the others still load)."""
    from importlib.metadata import entry_points

    failed = []
    for plugin in entry_points(group=PLUGIN_GROUP):
        try:
            plugin.load()
        except Exception as err:
            failed.append(f"rollout backend plugin {plugin.name} ({plugin.value}) failed to load: {err}")
    return failed


def register_rollout_backend(backend: RolloutBackend) -> RolloutBackend:
    """Add ``backend`` under its name (a second one under a taken name is refused); returns it."""
    if not backend.name:
        raise ValueError("a rollout backend needs a name")
    if backend.name in ROLLOUT_BACKENDS and ROLLOUT_BACKENDS[backend.name] is not backend:
        raise ValueError(f"rollout backend {backend.name!r} is registered already")
    ROLLOUT_BACKENDS[backend.name] = backend
    return backend


def rollout_backend(name: str) -> RolloutBackend:
    """The backend registered as ``name`` (installed plugins loaded first when it is not registered yet); a
    one-line ValueError listing the known ones otherwise."""
    failed = _load_plugins() if name not in ROLLOUT_BACKENDS else []
    try:
        return ROLLOUT_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(ROLLOUT_BACKENDS))
        why = "".join(f"; {line}" for line in failed)
        raise ValueError(
            f"rollout backend: expected a registered rollout backend ({known}), got {name!r}{why}"
        ) from None
