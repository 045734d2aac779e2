"""Vectorised reverse discounted scans (internal).

``suffix_discounted_sum(x, c)[..., t] = sum_{k >= t} c**(k - t) * x[..., k]`` computed with chunked
matrix products: each chunk of ``C`` steps is one ``[C, C]`` matmul, and the carries between chunks
are the same scan one level up with coefficient ``c**C``. Work is O(T * C), depth O(log_C T), and no
power of ``c`` larger than ``c**C`` appears, so it stays accurate for long sequences in float32.
"""

from __future__ import annotations

import functools

import torch

_CHUNK = 64


@functools.lru_cache(maxsize=64)
def _chunk_matrix(c: float, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``M[k, t] = c**(k - t)`` for ``k >= t`` else 0, so ``(x @ M)[t] = sum_{k>=t} c**(k-t) x[k]``."""
    idx = torch.arange(n, device=device)
    diff = idx[:, None] - idx[None, :]
    base = torch.tensor(c, dtype=torch.float64, device=device)
    m = torch.where(
        diff >= 0, base ** diff.clamp(min=0).to(torch.float64), torch.zeros((), dtype=torch.float64)
    )
    return m.to(dtype)


def suffix_discounted_sum(x: torch.Tensor, c: float) -> torch.Tensor:
    """Reverse discounted cumulative sum along the last dimension (see module docstring)."""
    t = x.shape[-1]
    if t <= _CHUNK:
        return x @ _chunk_matrix(float(c), t, x.dtype, x.device)
    n_chunks = -(-t // _CHUNK)
    pad = n_chunks * _CHUNK - t
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    chunks = xp.reshape(*x.shape[:-1], n_chunks, _CHUNK)
    local = chunks @ _chunk_matrix(float(c), _CHUNK, x.dtype, x.device)
    # local[..., j, 0] is chunk j's sum as if nothing followed it; the true value at chunk j's start is
    # S_j = local_j0 + c**C * S_{j+1}: the same scan over chunk starts with coefficient c**C.
    c_chunk = float(c) ** _CHUNK
    starts = suffix_discounted_sum(local[..., 0], c_chunk)
    carry = torch.nn.functional.pad(starts[..., 1:], (0, 1))  # S_{j+1}, zero after the last chunk
    decay = _chunk_matrix(float(c), _CHUNK + 1, x.dtype, x.device)[_CHUNK, :_CHUNK]  # c**(C - t), t in chunk
    out = local.add_(carry[..., None] * decay)
    return out.reshape(*x.shape[:-1], n_chunks * _CHUNK)[..., :t]


def compact_left(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the masked elements of each row to the front, in order; zeros after. Returns (packed, slot).

    ``slot[b, t]`` is where ``x[b, t]`` went (only meaningful where ``mask`` is set).
    """
    slot = mask.long().cumsum(-1) - 1
    packed = torch.zeros_like(x)
    src = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    index = torch.where(mask, slot, torch.full_like(slot, x.shape[-1] - 1))
    # Unmasked positions write 0 into the last slot; a real element can only own that slot when the
    # row is fully masked-in, in which case no unmasked position exists.
    packed.scatter_add_(-1, index, src)
    return packed, slot


def scatter_back(packed: torch.Tensor, slot: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`compact_left`: unmasked positions get 0."""
    out = packed.gather(-1, slot.clamp(min=0))
    return out * mask.to(out.dtype)


def has_holes(mask: torch.Tensor) -> bool:
    """True when some row's masked elements are not one contiguous run."""
    starts = mask[..., 1:] & ~mask[..., :-1]
    n_runs = starts.sum(-1) + mask[..., 0].long()
    return bool((n_runs > 1).any())
