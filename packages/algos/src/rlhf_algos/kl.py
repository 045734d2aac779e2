"""KL estimators and KL-coefficient controllers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

__all__ = ["AdaptiveKLController", "FixedKLController", "KLEstimator", "approx_kl"]

KLEstimator = Literal["k1", "k2", "k3", "k1+", "k3+"]


def approx_kl(
    logp: torch.Tensor, logp_ref: torch.Tensor, estimator: KLEstimator, *, clamp: float | None = None
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman, 2020,
    "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html).

    With ``x = log pi - log pi_ref``:
    ``k1 = x`` (unbiased, high variance); ``k2 = x**2 / 2`` (biased, low variance; its gradient is the
    unbiased KL gradient on-policy); ``k3 = exp(-x) - 1 + x`` (unbiased, low variance, always >= 0).
    ``k1+`` / ``k3+`` are straight-through: the value of k1 / k3 with the gradient of k2
    (``k2 + sg(k - k2)``), for use as a KL loss whose gradient is unbiased.
    ``clamp`` limits the result to ``[-clamp, clamp]`` when set.
    """
    if estimator not in get_args(KLEstimator):
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {get_args(KLEstimator)}")
    x = logp - logp_ref
    k2 = 0.5 * x.square()
    if estimator == "k2":
        out = k2
    else:
        base = x if estimator.startswith("k1") else torch.expm1(-x) + x
        out = k2 + (base - k2).detach() if estimator.endswith("+") else base
    return out.clamp(-clamp, clamp) if clamp is not None else out


@dataclass(kw_only=True)
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


@dataclass(kw_only=True)
class AdaptiveKLController:
    """Proportional KL controller (Ziegler et al., 2019, arXiv:1909.08593, section 2.2).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``.
    """

    value: float
    target: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"target and horizon must be positive, got {self.target}, {self.horizon}")

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
