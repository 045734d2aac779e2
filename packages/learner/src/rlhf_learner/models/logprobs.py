"""Per-token log-probabilities and entropies from logits: small pure functions."""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = [
    "CHUNK_ELEMENTS",
    "entropy_from_logits",
    "next_token_logprobs",
    "shift_to_inputs",
    "token_logprobs",
]


CHUNK_ELEMENTS = 1 << 25
"""Logits normalised at once by :func:`next_token_logprobs` (float32: 128 MiB): ``CHUNK_ELEMENTS // vocab``
tokens per chunk."""


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[..., labels]``.

    ``logits``: ``[..., vocab]``; ``labels``: ``[...]`` token ids. Returns ``[...]`` in ``logits``' dtype
    (computed in float32). The temperature must match the sampler's for the log-probs to be those of
    the sampled policy. Computed and differentiated a chunk of tokens at a time: see
    :func:`next_token_logprobs`.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} != logits shape {tuple(logits.shape[:-1])}")
    flat = logits.reshape(1, -1, logits.shape[-1])  # every position stands alone: one row
    out = next_token_logprobs(flat, labels.reshape(1, -1), temperature=temperature)
    return out.reshape(labels.shape)


def next_token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0, chunk_tokens: int | None = None
) -> torch.Tensor:
    """``[R, M]`` ``log softmax(logits[r, t] / temperature)[labels[r, t]]`` for the first ``M`` positions
    of each row of ``[R, L, vocab]`` ``logits`` (``M <= L``: position ``t`` predicts token ``t + 1``, so a
    model's logits pair with its ids shifted by one, ``M = L - 1``), in ``logits``' dtype.

    The same values as the whole ``log_softmax``, but float32 is only ever made ``chunk_tokens`` tokens at
    a time (default: ``CHUNK_ELEMENTS // vocab``), forward and backward: the backward pass keeps the
    logits (in their own dtype) and one log-normaliser per token, and makes the gradient
    ``(onehot(label) - softmax(z)) * grad / temperature`` chunk by chunk, instead of several
    ``[R, L, vocab]`` float32 tensors."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if logits.dim() != 3 or labels.dim() != 2 or labels.shape[0] != logits.shape[0]:
        raise ValueError(
            f"expected [R, L, V] logits and [R, M] labels, got {tuple(logits.shape)}, {tuple(labels.shape)}"
        )
    if labels.shape[1] > logits.shape[1]:
        raise ValueError(
            f"labels: {labels.shape[1]} per row, more than the logits' {logits.shape[1]} positions"
        )
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // logits.shape[-1])
    out = _NextTokenLogprobs.apply(logits, labels.long(), float(temperature), chunk)
    return out.to(logits.dtype)


def _spans(rows: int, width: int, chunk: int) -> Iterator[tuple[slice, slice]]:
    """``(rows, positions)`` slices covering every row's first ``width`` positions, about ``chunk`` tokens
    each: whole rows, several at a time, when a row fits in a chunk; else a row's positions in chunks."""
    if width <= chunk:
        step = chunk // max(width, 1)
        for r in range(0, rows, step):
            yield slice(r, min(r + step, rows)), slice(0, width)
        return
    for r in range(rows):
        for s in range(0, width, chunk):
            yield slice(r, r + 1), slice(s, min(s + chunk, width))


class _NextTokenLogprobs(torch.autograd.Function):
    """:func:`next_token_logprobs`' values (float32) and gradient, a chunk of tokens at a time."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk):  # type: ignore[override]
        lse = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        out = torch.empty_like(lse)
        for r, c in _spans(*labels.shape, chunk):
            z = logits[r, c].float() / temperature
            lse[r, c] = torch.logsumexp(z, dim=-1)
            out[r, c] = z.gather(-1, labels[r, c, None]).squeeze(-1) - lse[r, c]
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        logits, labels, lse = ctx.saved_tensors
        grad = torch.zeros_like(logits)  # positions past the labels' stay 0
        for r, c in _spans(*labels.shape, ctx.chunk):
            g = grad_out[r, c, None].float()
            z = logits[r, c].float() / ctx.temperature
            d = torch.exp(z - lse[r, c, None]).mul_(-g)
            d.scatter_add_(-1, labels[r, c, None], g)
            grad[r, c] = d.div_(ctx.temperature).to(grad.dtype)
        return grad, None, None, None


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
