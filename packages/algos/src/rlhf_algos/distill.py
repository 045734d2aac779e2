"""Distillation: on-policy (a teacher scores every token the student sampled) and offline (the student's
next-token distribution pulled towards the teacher's, over the vocabulary or the teacher's top k)."""

from __future__ import annotations

from typing import Literal

import torch

from rlhf_algos.masked import masked_mean
from rlhf_algos.returns import discounted_returns

__all__ = [
    "DistillLoss",
    "distill_advantages",
    "generalized_jsd",
    "reverse_kl",
    "token_divergence",
    "with_rest",
]

DistillLoss = Literal["forward_kl", "reverse_kl", "jsd"]


def distill_advantages(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, *, discount: float = 0.0
) -> torch.Tensor:
    """The per-token advantage of on-policy distillation: the negative reverse KL of each sampled token,

    ``a_t = log pi_T(y_t | y_<t) - log pi_theta(y_t | y_<t)``,

    summed over the action tokens that follow with ``discount`` (gamma):
    ``A_t = sum_{k >= t} gamma^(k - t) a_k`` (gamma = 0: each token its own, as in the reference recipe).
    Its expectation under the student is ``-KL(pi_theta || pi_T)`` per token, so a policy gradient on it
    moves the student towards the teacher on the student's own samples (Agarwal et al., 2024, GKD's
    on-policy variant, arXiv:2306.13649; Gu et al., 2024, MiniLLM, arXiv:2306.08543; Thinking Machines,
    2025, "On-Policy Distillation"). ``[batch, time]`` each; zero off ``mask``.
    """
    return discounted_returns(teacher_logp - student_logp, mask, gamma=discount)


def reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sampled estimate of ``KL(pi_theta || pi_T)`` per token: ``mean_t (log pi_theta - log pi_T)``
    over the action tokens (the student's samples make it unbiased; Schulman's k1)."""
    return masked_mean(student_logp - teacher_logp, mask)


def with_rest(logp: torch.Tensor) -> torch.Tensor:
    """Log-probs of K tokens (the teacher's top k) plus one outcome for every other token:
    ``[..., K] -> [..., K + 1]``, the last ``log(1 - sum_k p_k)``, floored at ``log 1e-12`` (for the
    whole vocabulary, K = V, it holds only the sum's rounding, about 1e-7 in float32). A divergence over these K + 1 outcomes is exact (the
    mass a distribution puts outside the K tokens counts), as in top-k distillation with a tail bucket."""
    total = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=0.0)
    rest = torch.log((-torch.expm1(total)).clamp(min=1e-12))
    return torch.cat([logp, rest], dim=-1)


def _kl(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """``KL(p || q) = sum_v p_v (log p_v - log q_v)`` over the last axis (0 log 0 = 0)."""
    p = p_logp.exp()
    return torch.where(p > 0, p * (p_logp - q_logp), torch.zeros_like(p)).sum(-1)


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalized Jensen-Shannon divergence (Agarwal et al., 2024, arXiv:2306.13649, Eq. 2),
    with ``M = beta * p_T + (1 - beta) * p_S``:

    ``JSD(beta) = beta * KL(p_T || M) + (1 - beta) * KL(p_S || M)``,

    per position over the last axis (log-probs in, ``beta`` in (0, 1); beta = 0.5 is the symmetric JSD).
    As beta nears 0 it behaves like ``beta * KL(p_T || p_S)`` (forward), as it nears 1 like
    ``(1 - beta) * KL(p_S || p_T)`` (reverse)."""
    if not 0 < beta < 1:
        raise ValueError(f"beta: expected a value in (0, 1), got {beta}")
    b = torch.tensor(beta, dtype=student_logp.dtype, device=student_logp.device)
    mix = torch.logsumexp(torch.stack([teacher_logp + b.log(), student_logp + (1 - b).log()]), dim=0)
    return beta * _kl(teacher_logp, mix) + (1 - beta) * _kl(student_logp, mix)


def token_divergence(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, *, loss: DistillLoss, beta: float = 0.5
) -> torch.Tensor:
    """Per-position divergence of the student's next-token distribution from the teacher's, ``[...]`` from
    ``[..., V]`` log-probs over the same outcomes (the vocabulary, or the teacher's top k and the rest of the
    vocabulary as one outcome, :func:`with_rest`):

    - ``forward_kl``: ``KL(p_T || p_S)``, classic knowledge distillation (Hinton et al., 2015,
      arXiv:1503.02531): mode-covering;
    - ``reverse_kl``: ``KL(p_S || p_T)``, mode-seeking (Gu et al., 2024, MiniLLM, arXiv:2306.08543);
    - ``jsd``: :func:`generalized_jsd` with ``beta`` (GKD).
    """
    if loss == "forward_kl":
        return _kl(teacher_logp, student_logp)
    if loss == "reverse_kl":
        return _kl(student_logp, teacher_logp)
    if loss == "jsd":
        return generalized_jsd(student_logp, teacher_logp, beta)
    raise ValueError(f"loss: expected forward_kl, reverse_kl or jsd, got {loss!r}")
