"""From sequence scores to per-token rewards: group shaping, KL penalty, clipping, length penalties."""

from __future__ import annotations

from typing import Literal, get_args

import torch

from rlhf_algos._checks import as_bool_mask, check_finite, check_same_shape

__all__ = [
    "GroupShaping",
    "group_shaped_rewards",
    "overlong_penalty",
    "stop_penalty",
    "token_level_rewards",
]

GroupShaping = Literal["rloo", "reinforce_baseline", "group_norm", "dr_grpo"]


def group_shaped_rewards(
    rewards: torch.Tensor, estimator: GroupShaping, *, eps: float = 1e-6
) -> torch.Tensor:
    """Shape the rewards of ``n`` samples of each prompt against their group.

    ``rewards`` is ``[num_prompts, n_samples]``; the result has the same shape.

    - ``rloo``: ``r_i - mean_{j != i} r_j`` (leave-one-out baseline; Ahmadian et al., 2024,
      arXiv:2402.14740).
    - ``reinforce_baseline``: ``r_i - mean_j r_j`` (REINFORCE++-baseline; Hu et al., 2025,
      arXiv:2501.03262; global whitening follows in the estimator).
    - ``group_norm``: ``(r_i - mean_j r_j) / (std_j r_j + eps)`` with the unbiased std (GRPO; Shao et
      al., 2024, arXiv:2402.03300).
    - ``dr_grpo``: ``r_i - mean_j r_j`` with no std division (Dr. GRPO; Liu et al., 2025,
      arXiv:2503.20783).
    """
    if estimator not in get_args(GroupShaping):
        raise ValueError(f"unknown group shaping {estimator!r}; expected one of {get_args(GroupShaping)}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_prompts, n_samples], got shape {tuple(rewards.shape)}")
    n = rewards.shape[1]
    if n < 2:
        raise ValueError(f"{estimator} needs at least 2 samples per prompt (n_samples_per_prompt), got {n}")
    check_finite("rewards", rewards)
    mean = rewards.mean(-1, keepdim=True)
    if estimator == "rloo":
        return (rewards - mean) * (n / (n - 1))  # == r_i - (sum - r_i) / (n - 1)
    if estimator == "group_norm":
        return (rewards - mean) / (rewards.std(-1, keepdim=True) + eps)
    return rewards - mean


def last_action_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last set element of each row; raises naming the row if a row is empty."""
    m = as_bool_mask(mask)
    empty = ~m.any(-1)
    if bool(empty.any()):
        raise ValueError(
            f"action mask of row {int(empty.nonzero()[0])} is empty: no token can hold its reward"
        )
    pos = torch.arange(m.shape[-1], device=m.device).expand_as(m)
    return torch.where(m, pos, torch.full_like(pos, -1)).amax(-1)


def token_level_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    reward_clip: float | None = None,
) -> torch.Tensor:
    """Per-token rewards: ``r_t = -kl_coef * kl_t`` on action tokens, plus the sequence score at the
    last action token (Ziegler et al., 2019, arXiv:1909.08593; Ouyang et al., 2022).

    Args:
        scores: ``[batch]`` sequence rewards; clipped to ``[-reward_clip, reward_clip]`` when set.
        mask: ``[batch, time]`` action mask (may have holes; the score goes to the last action token).
        kl: ``[batch, time]`` per-token KL estimate (see :func:`rlhf_algos.approx_kl`), or ``None``.
    """
    m = as_bool_mask(mask)
    if scores.shape != m.shape[:1]:
        raise ValueError(f"scores must be [batch]={tuple(m.shape[:1])}, got {tuple(scores.shape)}")
    check_finite("scores", scores)
    if reward_clip is not None:
        if reward_clip <= 0:
            raise ValueError(f"reward_clip must be positive, got {reward_clip}")
        scores = scores.clamp(-reward_clip, reward_clip)
    rewards = torch.zeros(m.shape, dtype=scores.dtype, device=scores.device)
    if kl is not None and kl_coef != 0.0:
        check_same_shape(kl=kl, mask=m)
        check_finite("kl", torch.where(m, kl, torch.zeros((), dtype=kl.dtype)))
        rewards = rewards - kl_coef * kl.to(scores.dtype) * m.to(scores.dtype)
    last = last_action_index(m)
    return rewards.scatter_add(-1, last[:, None], scores[:, None])


def overlong_penalty(
    lengths: torch.Tensor, *, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al., 2025, arXiv:2503.14476), added to the reward.

    With ``L_max = max_length`` and ``L_cache = buffer_length``: 0 when ``L <= L_max - L_cache``;
    ``((L_max - L_cache) - L) / L_cache * penalty_factor`` inside the buffer; ``-penalty_factor``
    beyond ``L_max``.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"buffer_length must be in (0, max_length={max_length}], got {buffer_length}")
    start = max_length - buffer_length
    ramp = (start - lengths.to(torch.float32)) / buffer_length * penalty_factor
    pen = torch.where(lengths > start, ramp, torch.zeros_like(ramp))
    return pen.clamp(min=-penalty_factor)


def stop_penalty(rewards: torch.Tensor, truncated: torch.Tensor, *, coef: float) -> torch.Tensor:
    """Penalise responses that did not stop by themselves (hit the length limit).

    ``coef >= 0`` multiplies a truncated response's reward by ``coef``; ``coef < 0`` replaces it with
    ``coef``. Responses that stopped keep their reward.
    """
    check_same_shape(rewards=rewards, truncated=truncated)
    t = as_bool_mask(truncated)
    new = rewards * coef if coef >= 0 else torch.full_like(rewards, coef)
    return torch.where(t, new, rewards)
