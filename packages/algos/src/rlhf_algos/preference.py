"""Preference and reward-model losses on sequence log-probabilities / scores."""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F

__all__ = ["DPOLossOutput", "DPOVariant", "dpo_loss", "kto_kl_baseline", "kto_loss", "pairwise_rm_loss"]

DPOVariant = Literal["dpo", "ipo", "cdpo"]


class DPOLossOutput(NamedTuple):
    loss: torch.Tensor
    """``[batch]`` per-pair loss."""
    chosen_rewards: torch.Tensor
    """``beta * (log pi(y_w) - log pi_ref(y_w))``, detached."""
    rejected_rewards: torch.Tensor
    """``beta * (log pi(y_l) - log pi_ref(y_l))``, detached."""


def dpo_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    *,
    beta: float,
    variant: DPOVariant = "dpo",
    label_smoothing: float = 0.0,
) -> DPOLossOutput:
    """Direct preference losses on summed sequence log-probs.

    With ``h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))``:

    - ``dpo``: ``-log sigmoid(beta * h)`` (Rafailov et al., 2023, arXiv:2305.18290).
    - ``cdpo``: ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`` with
      ``eps = label_smoothing`` (conservative DPO, Mitchell, 2023).
    - ``ipo``: ``(h - 1 / (2 beta))**2`` (Azar et al., 2023, arXiv:2310.12036).
    """
    if variant not in get_args(DPOVariant):
        raise ValueError(f"unknown DPO variant {variant!r}; expected one of {get_args(DPOVariant)}")
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if variant != "cdpo" and label_smoothing:
        raise ValueError(f"label_smoothing is only used by variant='cdpo', got variant={variant!r}")
    chosen = chosen_logp - ref_chosen_logp
    rejected = rejected_logp - ref_rejected_logp
    h = chosen - rejected
    if variant == "ipo":
        loss = (h - 1.0 / (2.0 * beta)).square()
    else:
        eps = label_smoothing
        loss = -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    return DPOLossOutput(loss, (beta * chosen).detach(), (beta * rejected).detach())


def kto_kl_baseline(policy_kl_logp: torch.Tensor, ref_kl_logp: torch.Tensor) -> torch.Tensor:
    """KTO reference point ``z_0 = max(0, mean(log pi(y'|x) - log pi_ref(y'|x)))`` over mismatched
    pairs ``(x, y')`` of the batch, detached (Ethayarajh et al., 2024, arXiv:2402.01306)."""
    return (policy_kl_logp - ref_kl_logp).mean().clamp(min=0).detach()


def kto_loss(
    policy_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    desirable: torch.Tensor,
    kl_baseline: torch.Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """Kahneman-Tversky Optimisation loss per example (Ethayarajh et al., 2024, arXiv:2402.01306).

    With ``r = log pi(y|x) - log pi_ref(y|x)`` and reference point ``z_0`` (:func:`kto_kl_baseline`):
    desirable ``lambda_D * (1 - sigmoid(beta * (r - z_0)))``; undesirable
    ``lambda_U * (1 - sigmoid(beta * (z_0 - r)))``.
    """
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    r = policy_logp - ref_logp
    d = desirable.bool()
    good = desirable_weight * (1.0 - torch.sigmoid(beta * (r - kl_baseline)))
    bad = undesirable_weight * (1.0 - torch.sigmoid(beta * (kl_baseline - r)))
    return torch.where(d, good, bad)


def pairwise_rm_loss(
    chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, *, margin: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """Bradley-Terry reward-model loss ``-log sigmoid(r_w - r_l - margin)`` per pair (Ouyang et al.,
    2022, arXiv:2203.02155; the margin as in Llama 2, arXiv:2307.09288)."""
    return -F.logsigmoid(chosen_scores - rejected_scores - margin)
