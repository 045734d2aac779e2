"""Sample filters applied between rollout and training."""

from __future__ import annotations

import torch

from rlhf_algos._checks import check_finite

__all__ = ["dynamic_filter"]


def dynamic_filter(scores: torch.Tensor, *, low: float, high: float) -> torch.Tensor:
    """DAPO dynamic sampling (Yu et al., 2025, arXiv:2503.14476): keep a prompt's group only when its
    mean score lies in the open range ``(low, high)``, e.g. ``(0, 1)`` drops groups that are all
    right or all wrong (they carry no group-relative signal).

    Args:
        scores: ``[num_prompts, n_samples]``.
    Returns:
        ``[num_prompts]`` bool, True for groups to keep.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [num_prompts, n_samples], got shape {tuple(scores.shape)}")
    if not low < high:
        raise ValueError(f"dynamic filter range must satisfy low < high, got ({low}, {high})")
    check_finite("scores", scores)
    mean = scores.mean(-1)
    return (mean > low) & (mean < high)
