"""Log-probs under a frozen model (reference, or the old policy before an update)."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_learner.steps.batches import ModelRows
from rlhf_learner.steps.supervised import sequence_logp

__all__ = ["reference_logp", "reference_sequence_logp"]


@torch.no_grad()
def reference_logp(model: Any, rows: ModelRows) -> torch.Tensor:
    """``[B, T]`` per-token log-probs of ``rows.input_ids`` under ``model`` (an ``Actor`` or an engine
    wrapping one), without gradients, on the model's device. ``rows`` is any batch of the steps."""
    rows = rows.to(next(model.parameters()).device)
    return model(rows.input_ids, **rows.model_inputs()).logp.detach()


@torch.no_grad()
def reference_sequence_logp(model: Any, rows: ModelRows, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` summed log-probs of the ``loss_mask`` tokens of each row (what ``DPOBatch`` and
    ``KTOBatch`` take as ``ref_logp``)."""
    logp = reference_logp(model, rows)
    return sequence_logp(logp, loss_mask.to(logp.device))
