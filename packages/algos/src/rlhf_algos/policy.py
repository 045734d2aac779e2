"""PPO-family policy loss and clipped value loss, per token (aggregate with :func:`aggregate_loss`)."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from rlhf_algos._checks import as_bool_mask, check_same_shape

__all__ = ["PolicyLossOutput", "RatioType", "policy_loss", "value_loss"]

RatioType = Literal["token", "sequence"]


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor
    """``[batch, time]`` per-token loss, zero where the mask is 0."""
    clipped: torch.Tensor
    """``[batch, time]`` bool: the clipped branch was active (for the clip fraction)."""
    ratio: torch.Tensor
    """``[batch, time]`` importance ratio used (detached)."""


def _sequence_ratio(log_ratio: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """GSPO-token ratio ``sg(s_i) * pi_t / sg(pi_t)`` with ``s_i = exp(mean_t log_ratio)``."""
    mf = m.to(log_ratio.dtype)
    seq = (log_ratio * mf).sum(-1) / mf.sum(-1).clamp(min=1)
    return torch.exp(seq.detach()[:, None] + log_ratio - log_ratio.detach())


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    ratio_type: RatioType = "token",
    is_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> PolicyLossOutput:
    """Clipped surrogate objective, negated (Schulman et al., 2017, arXiv:1707.06347).

    ``r = exp(logp - old_logp)``; ``L = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``.

    - Asymmetric clip ("clip-higher", DAPO, arXiv:2503.14476): ``clip_eps_high`` defaults to
      ``clip_eps_low``.
    - Dual clip (Ye et al., 2020, arXiv:1912.09729): for ``A < 0`` the loss is capped at
      ``-dual_clip * A`` (``dual_clip > 1``).
    - ``ratio_type="sequence"``: GSPO (Zheng et al., 2025, arXiv:2507.18071) uses the length-normalised
      sequence ratio ``s_i = exp(mean_t (logp - old_logp))`` for every token of sequence ``i``
      (GSPO-token form, so per-token advantages still work); use small eps such as 3e-4 / 4e-4.
    - ``is_weights``: per-token off-policy correction weights (see :func:`vllm_is_weights`), applied as
      a detached multiplier.
    - ``entropy``: per-token policy entropy; the loss gets ``- entropy_coef * entropy`` (a bonus).
    """
    check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if clip_eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip eps must be >= 0, got low={clip_eps_low} high={eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    m = as_bool_mask(mask)
    log_ratio = logp - old_logp
    if ratio_type == "sequence":
        ratio = _sequence_ratio(log_ratio, m)
    elif ratio_type == "token":
        ratio = torch.exp(log_ratio)
    else:
        raise ValueError(f"ratio_type must be 'token' or 'sequence', got {ratio_type!r}")
    surr1 = -advantages * ratio
    surr2 = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + eps_high)
    loss = torch.maximum(surr1, surr2)
    clipped = surr2 > surr1
    if dual_clip is not None:
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
        clipped = clipped | capped
    if is_weights is not None:
        check_same_shape(is_weights=is_weights, mask=m)
        loss = loss * is_weights.detach()
    if entropy is not None and entropy_coef != 0.0:
        check_same_shape(entropy=entropy, mask=m)
        loss = loss - entropy_coef * entropy
    mf = m.to(loss.dtype)
    return PolicyLossOutput(loss * mf, clipped & m, ratio.detach())


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float | None = None,
) -> torch.Tensor:
    """Per-token value loss ``0.5 * (V - R)**2``; with ``clip_eps`` the PPO clipped form
    ``0.5 * max((V - R)**2, (old_V + clip(V - old_V, -eps, eps) - R)**2)`` (Schulman et al., 2017;
    as in OpenAI baselines ppo2). Zero where ``mask`` is 0.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    err = (values - returns).square()
    if clip_eps is not None:
        if clip_eps <= 0:
            raise ValueError(f"value clip_eps must be positive, got {clip_eps}")
        clipped_v = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        err = torch.maximum(err, (clipped_v - returns).square())
    return 0.5 * err * as_bool_mask(mask).to(err.dtype)
