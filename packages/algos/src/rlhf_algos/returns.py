"""Generalised advantage estimation and discounted returns over token sequences.

Masks may have holes (multi-turn rollouts mask environment tokens in the middle of a row). Only
masked-in tokens are decision steps: the step after an action token is the next *action* token, so
holes are skipped, not treated as zero-reward steps. Unmasked positions get 0 in every output.
"""

from __future__ import annotations

import torch

from rlhf_algos._checks import as_bool_mask, check_same_shape, masked_finite
from rlhf_algos._scan import compact_left, has_holes, scatter_back, suffix_discounted_sum

__all__ = ["discounted_returns", "gae"]


def _validate(
    mask: torch.Tensor, gamma: float, **tensors: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Check shapes, gamma and finiteness on action tokens; return the bool mask and clean tensors."""
    check_same_shape(mask=mask, **tensors)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    m = as_bool_mask(mask)
    return m, [masked_finite(name, x, m) for name, x in tensors.items()]


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016, arXiv:1506.02438).

    For action tokens ``t`` with next action token ``t'`` (``V_{t'} = 0`` after the last one):
    ``delta_t = r_t + gamma * V_{t'} - V_t`` and ``A_t = sum_l (gamma * lam)**l * delta_{t+l}`` over
    the following action tokens; returns ``R_t = A_t + V_t``.

    Args:
        rewards, values, mask: ``[batch, time]``; ``mask`` marks action tokens.
    Returns:
        ``(advantages, returns)``, each ``[batch, time]``, zero where ``mask`` is 0.
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    m, (rewards, values) = _validate(mask, gamma, rewards=rewards, values=values)
    mf = m.to(values.dtype)
    if has_holes(m):
        r, slot = compact_left(rewards, m)
        v, _ = compact_left(values, m)
        valid = (torch.arange(m.shape[-1], device=m.device) < m.sum(-1, keepdim=True)).to(v.dtype)
    else:
        r, v, valid, slot = rewards, values * mf, mf, None
    next_v = torch.nn.functional.pad(v[..., 1:], (0, 1))  # V of the next action token; 0 after the last
    delta = torch.add(r, next_v, alpha=gamma).sub_(v).mul_(valid)
    adv = suffix_discounted_sum(delta, gamma * lam)
    if slot is None:
        adv.mul_(mf)  # positions before the first action token picked up discounted mass
        return adv, adv + v
    adv = scatter_back(adv, slot, m)
    return adv, adv + values * mf


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """Discounted return over action tokens: ``G_t = r_t + gamma * G_{t'}`` (Williams, 1992).

    ``t'`` is the next action token (holes skipped); zero where ``mask`` is 0. With ``gamma = 1`` this
    is the reward-to-go used by REINFORCE++ / RLOO / GRPO with token-level KL rewards.
    """
    m, (rewards,) = _validate(mask, gamma, rewards=rewards)
    if has_holes(m):
        r, slot = compact_left(rewards, m)
        return scatter_back(suffix_discounted_sum(r, gamma), slot, m)
    mf = m.to(rewards.dtype)
    return suffix_discounted_sum(rewards * mf, gamma).mul_(mf)
