"""Rollout backends behind one registry: what each engine kind is, can do, takes and costs.

A backend registers itself (:func:`register_rollout_backend`) from its own module; everything else
(engine actors, the CLI's configuration, plan and weight-sync choice) asks the registry what a backend
can do instead of comparing its name. ``vllm`` and ``transformers`` are registered on import.
"""

from rlhf_rollout.backends.registry import (
    ROLLOUT_BACKENDS,
    BackendCapabilities,
    EngineMemory,
    EngineSettings,
    MemoryQuery,
    RolloutBackend,
    register_rollout_backend,
    rollout_backend,
)
from rlhf_rollout.backends.transformers import TransformersBackend  # registers "transformers"
from rlhf_rollout.backends.vllm import VLLMBackend  # registers "vllm"

__all__ = [
    "ROLLOUT_BACKENDS",
    "BackendCapabilities",
    "EngineMemory",
    "EngineSettings",
    "MemoryQuery",
    "RolloutBackend",
    "TransformersBackend",
    "VLLMBackend",
    "register_rollout_backend",
    "rollout_backend",
]
