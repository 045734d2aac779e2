"""Masked reductions and whitening."""

from __future__ import annotations

import torch

from rlhf_algos._checks import as_bool_mask

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten"]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask)`` over ``dim`` (all elements when ``None``)."""
    m = as_bool_mask(mask).to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)``; raises if the mask selects nothing."""
    m = as_bool_mask(mask).to(x.dtype)
    count = m.sum() if dim is None else m.sum(dim)
    if bool((count == 0).any()):
        raise ValueError("masked_mean: the mask selects no element")
    return masked_sum(x, m, dim) / count


def masked_var(x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements (Bessel-corrected when ``unbiased``)."""
    m = as_bool_mask(mask)
    n = m.sum()
    if unbiased and int(n) < 2:
        raise ValueError("masked_var: need at least 2 masked elements for an unbiased variance")
    mean = masked_mean(x, m)
    sq = masked_sum((x - mean) ** 2, m)
    return sq / (n - 1) if unbiased else sq / n


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, scale: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten the masked elements: ``(x - mean) / sqrt(var + eps)``; masked-out elements become 0.

    ``shift_mean=False`` keeps the mean (divide only); ``scale=False`` subtracts the mean only
    (whitening "without std"). Statistics are over all masked elements of the batch, as in
    REINFORCE++ (Hu et al., 2025, arXiv:2501.03262) global advantage normalisation.
    """
    m = as_bool_mask(mask)
    mean = masked_mean(x, m)
    out = x
    if scale:
        out = (x - mean) * torch.rsqrt(masked_var(x, m) + eps)
        if not shift_mean:
            out = out + mean
    elif shift_mean:
        out = x - mean
    return out * m.to(x.dtype)
