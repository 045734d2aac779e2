"""The worker-extension trio for an engine that holds a plain torch module (e.g. rlhf-rollout's
``TransformersEngine``): the same ``init_weight_sync`` / ``receive_weights`` / ``close_weight_sync`` as
the vLLM extension, loading with :func:`~rlhf_weightsync.loaders.copy_into` into ``self.model``."""

from __future__ import annotations

from rlhf_weightsync.loaders import copy_into
from rlhf_weightsync.vllm_ext import WeightSyncWorkerExtension

__all__ = ["ModuleWeightSyncExtension"]


class ModuleWeightSyncExtension(WeightSyncWorkerExtension):
    """Mixed into a worker object with a ``model`` attribute (a ``torch.nn.Module``, one process, no
    tensor parallelism). A sync must hold every parameter of the model, as ``named_parameters()`` lists
    them (a tied weight once, under its first name), and nothing else (``copy_into(strict=True)``); a
    vision-language model's vision tower may be left out (frozen, it is not sent)."""

    def _rlhf_sync_rank(self) -> int:
        return 0

    def _rlhf_load_callback(self):
        model = self.model  # type: ignore[attr-defined]
        vision = getattr(getattr(model, "config", None), "vision_config", None) is not None
        tower = (lambda name: ".visual." in f".{name}") if vision else None
        return copy_into(dict(model.named_parameters()), optional=tower)
