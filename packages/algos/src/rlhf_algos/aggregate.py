"""Loss aggregation that gives the same gradient however the batch is split.

A step's batch is spread over data-parallel ranks and gradient-accumulation micro-batches. Each
micro-batch returns ``sum(its terms) / global_denominator * dp_size``: summing micro-batch gradients
(accumulation) and averaging over ranks (the usual all-reduce) then gives exactly the loss of the
whole batch. ``global_tokens`` / ``global_seqs`` are counted over the whole window and all ranks
(the caller all-reduces the counts once per step).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from rlhf_algos._checks import as_bool_mask, check_same_shape

__all__ = ["LossAggregation", "aggregate_loss", "sft_loss"]

LossAggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    horizon: int | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Reduce a ``[batch, time]`` per-token loss to a scalar.

    With ``T`` = masked tokens and ``S`` = sequences with at least one masked token, both over the
    whole step (``global_tokens`` / ``global_seqs``; default: this batch), and ``n_i`` the masked
    tokens of sequence ``i``:

    - ``token-mean``: ``sum_{i,t} l_it / T`` (DAPO, arXiv:2503.14476).
    - ``seq-mean-token-mean``: ``sum_i (sum_t l_it / n_i) / S`` (GRPO, arXiv:2402.03300).
    - ``seq-mean-token-sum``: ``sum_i sum_t l_it / S``.
    - ``seq-mean-token-sum-norm``: ``sum_i sum_t l_it / (S * horizon)`` with a fixed ``horizon``
      such as the maximum response length (Dr. GRPO, arXiv:2503.20783). ``horizon`` is required:
      the padded width of a micro-batch would make the loss depend on how the batch was split.

    The result is multiplied by ``dp_size`` so that the data-parallel gradient *average* equals the
    gradient of the global loss.
    """
    if mode not in get_args(LossAggregation):
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {get_args(LossAggregation)}")
    check_same_shape(loss=loss, mask=mask)
    m = as_bool_mask(mask)
    mf = m.to(loss.dtype)
    per_seq_tokens = mf.sum(-1)
    if mode == "token-mean":
        denom = per_seq_tokens.sum() if global_tokens is None else global_tokens
        total = (loss * mf).sum()
    else:
        denom = (per_seq_tokens > 0).sum() if global_seqs is None else global_seqs
        seq_sum = (loss * mf).sum(-1)
        if mode == "seq-mean-token-mean":
            total = (seq_sum / per_seq_tokens.clamp(min=1)).sum()
        elif mode == "seq-mean-token-sum":
            total = seq_sum.sum()
        else:
            if horizon is None or horizon <= 0:
                raise ValueError(
                    "seq-mean-token-sum-norm needs a positive horizon (e.g. the max response length)"
                )
            total = seq_sum.sum() / horizon
    if float(denom) <= 0:
        raise ValueError(f"{mode}: nothing to average over (the mask selects no token in the whole step)")
    return total / denom * dp_size


def sft_loss(
    logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: LossAggregation = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Supervised fine-tuning loss: the negative log-likelihood ``-log pi(y_t | y_<t, x)`` of the
    target tokens selected by ``mask``, aggregated with :func:`aggregate_loss`."""
    return aggregate_loss(
        -logp, mask, mode, global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size
    )
