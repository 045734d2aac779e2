"""The ``transformers`` rollout backend: ``TransformersEngine`` (transformers' ``generate``) in its actor."""

from __future__ import annotations

from typing import Any

from rlhf_rollout.backends.registry import (
    BackendCapabilities,
    EngineSettings,
    RolloutBackend,
    register_rollout_backend,
)

__all__ = ["TransformersBackend"]


class TransformersBackend(RolloutBackend):
    name = "transformers"
    capabilities = BackendCapabilities(
        tensor_parallel=False,
        asynchronous=False,
        sleep=False,
        gpu_weight_transports=False,
        seeded_calls=False,
        logprobs=True,
        compiles=False,
    )
    worker_extension = "rlhf_weightsync.module_ext.ModuleWeightSyncExtension"

    def make_engine(self, engine_kwargs: dict[str, Any]) -> Any:
        from rlhf_rollout.hf_engine import TransformersEngine

        return TransformersEngine(**engine_kwargs)

    def engine_kwargs(self, settings: EngineSettings) -> dict[str, Any]:
        return {
            "model": settings.model,
            "max_model_len": settings.max_model_len,
            "worker_extension_cls": self.worker_extension,
            "dtype": "float32" if settings.dtype == "auto" else settings.dtype,
            "device": "cuda" if settings.gpu else "cpu",
        }


register_rollout_backend(TransformersBackend())
