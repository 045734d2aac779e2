"""On-policy distillation: a teacher scores every token the student sampled."""

from __future__ import annotations

import torch

from rlhf_algos.masked import masked_mean
from rlhf_algos.returns import discounted_returns

__all__ = ["distill_advantages", "reverse_kl"]


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
