"""Log-probs under a frozen model (reference, or the old policy before an update)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlhf_learner.steps.ppo import _model_inputs
from rlhf_learner.steps.supervised import sequence_logp

__all__ = ["reference_logp", "reference_sequence_logp"]


@torch.no_grad()
def reference_logp(model: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    """``[B, T]`` per-token log-probs of ``batch["input_ids"]`` under ``model`` (an ``Actor`` or an
    engine wrapping one), without gradients, on the model's device."""
    device = next(model.parameters()).device
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return model(moved["input_ids"], **_model_inputs(moved)).logp.detach()


@torch.no_grad()
def reference_sequence_logp(
    model: Any, batch: Mapping[str, Any], *, mask_key: str = "loss_mask"
) -> torch.Tensor:
    """``[B]`` summed log-probs of the masked tokens (what DPO / KTO steps take as ``ref_logp``)."""
    return sequence_logp(reference_logp(model, batch), batch[mask_key])
