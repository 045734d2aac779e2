"""Off-policy correction between the rollout engine's and the learner's log-probabilities."""

from __future__ import annotations

from typing import Literal, get_args

import torch

from rlhf_algos._checks import as_bool_mask, check_finite, check_same_shape

__all__ = ["ISCorrection", "vllm_is_weights"]

ISCorrection = Literal["tis", "icepop", "seq-mask-tis"]


def vllm_is_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: ISCorrection,
    *,
    low: float = 0.0,
    high: float = 2.0,
) -> torch.Tensor:
    """Per-token importance weights that correct for the inference engine's sampling mismatch.

    ``rho_t = exp(old_logp_t - rollout_logp_t)`` compares the learner's log-prob of the sampled token
    with the engine's. Weights are detached and zero outside ``mask``.

    - ``tis``: truncated IS ``w_t = clip(rho_t, low, high)`` (Yao et al., 2025, "Your Efficient RL
      Framework Secretly Brings You Off-Policy RL Training").
    - ``icepop``: ``w_t = rho_t`` if ``low <= rho_t <= high`` else 0: tokens with a large mismatch
      are dropped (IcePop, Ling Team, 2025, arXiv:2510.18855).
    - ``seq-mask-tis``: a sequence whose geometric-mean ratio ``exp(mean_t log rho_t)`` lies outside
      ``[low, high]`` is dropped whole; the others get ``min(rho_t, high)``.
    """
    if mode not in get_args(ISCorrection):
        raise ValueError(f"unknown IS correction {mode!r}; expected one of {get_args(ISCorrection)}")
    if not 0.0 <= low < high:
        raise ValueError(f"need 0 <= low < high, got low={low} high={high}")
    check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp, mask=mask)
    m = as_bool_mask(mask)
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
    log_rho = torch.where(m, old_logp.detach() - rollout_logp.detach(), zero)
    check_finite("log importance ratio (old_logp - rollout_logp)", log_rho)
    rho = torch.exp(log_rho)
    if mode == "tis":
        w = rho.clamp(low, high)
    elif mode == "icepop":
        w = torch.where((rho >= low) & (rho <= high), rho, zero)
    else:
        mf = m.to(log_rho.dtype)
        seq = torch.exp(log_rho.sum(-1) / mf.sum(-1).clamp(min=1))
        keep = (seq >= low) & (seq <= high)
        w = torch.where(keep[:, None], rho.clamp(max=high), zero)
    return w * m.to(w.dtype)
