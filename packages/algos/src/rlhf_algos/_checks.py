"""Input checks shared by the estimators (internal)."""

from __future__ import annotations

import torch


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``name`` and the first bad index if ``x`` has NaN or inf."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} contains a non-finite value ({x[idx].item()}) at index {idx}")


def masked_finite(name: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Check that ``x`` is finite where ``mask`` is set; return ``x`` with unmasked entries zeroed
    only when they are not finite (so callers can mask by multiplication)."""
    if bool(torch.isfinite(x.sum())):  # fast path: one reduction, no temporaries
        return x
    x = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    check_finite(name, x)
    return x


def check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0
