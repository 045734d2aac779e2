"""Per-token log-probabilities and entropies from logits: small pure functions."""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits", "shift_to_inputs", "token_logprobs"]


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[..., labels]``.

    ``logits``: ``[..., vocab]``; ``labels``: ``[...]`` token ids. Returns ``[...]`` in ``logits``' dtype
    (computed in float32). The temperature must match the sampler's for the log-probs to be those of
    the sampled policy.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} != logits shape {tuple(logits.shape[:-1])}")
    z = logits.float() / temperature
    picked = z.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(z, dim=-1)).to(logits.dtype)


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy ``H = logsumexp(z) - sum_v softmax(z)_v z_v`` of ``softmax(logits / temperature)``, ``[...]``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    z = logits.float() / temperature
    p = torch.softmax(z, dim=-1)
    return (torch.logsumexp(z, dim=-1) - (p * z).sum(-1)).to(logits.dtype)


def shift_to_inputs(per_position: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Re-align a ``[B, T-1]`` "prediction of token t+1 from position t" tensor onto the inputs.

    Returns ``[B, T]`` where column ``t`` holds the value for input token ``t`` (its log-prob given the
    tokens before it). Column 0, and with packed ``position_ids`` every position where a sequence
    starts (``position_ids == 0``), has no prediction and is set to 0.
    """
    pad = per_position.new_zeros(per_position.shape[0], 1)
    out = torch.cat([pad, per_position], dim=1)
    if position_ids is not None:
        out = out.masked_fill(position_ids.to(out.device) == 0, 0.0)
    return out
