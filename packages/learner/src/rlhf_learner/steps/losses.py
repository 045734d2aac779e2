"""The loss functions the update steps take, as Protocols: what a caller's function (e.g. rlhf-algos'
``policy_loss``, ``aggregate_loss``, ``dpo_loss``) must accept and return. The learner imports no loss
library; any function with these signatures works."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = [
    "AggregateFn",
    "DPOLossFn",
    "DivergenceFn",
    "ISWeightsFn",
    "KLBaselineFn",
    "KLLossFn",
    "KTOLossFn",
    "PairLossFn",
    "PolicyLossFn",
    "SFTLossFn",
    "ValueLossFn",
]


class PolicyLossFn(Protocol):
    """Per-token policy loss ``[B, T]`` (a tensor, or a result with ``.loss`` and optionally ``.clipped``);
    keyword arguments may include ``is_weights``, ``entropy`` and ``entropy_coef``."""

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        **kw: Any,
    ) -> Any: ...


class AggregateFn(Protocol):
    """Per-token loss ``[B, T]`` -> the micro-batch's scalar, normalised by the whole step's counts."""

    def __call__(
        self,
        per_token: torch.Tensor,
        mask: torch.Tensor,
        *,
        global_tokens: float,
        global_seqs: float,
        dp_size: int,
    ) -> torch.Tensor: ...


class KLLossFn(Protocol):
    """Per-token KL estimate ``[B, T]`` of the policy against the reference."""

    def __call__(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor: ...


class ISWeightsFn(Protocol):
    """Per-token importance weights ``[B, T]`` correcting for the rollout engine's log-probs."""

    def __call__(
        self, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor: ...


class ValueLossFn(Protocol):
    """Per-token value loss ``[B, T]``."""

    def __call__(
        self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor: ...


class SFTLossFn(Protocol):
    """The micro-batch's scalar NLL of the masked tokens, normalised by the whole step's counts."""

    def __call__(
        self,
        logp: torch.Tensor,
        mask: torch.Tensor,
        *,
        global_tokens: float,
        global_seqs: float,
        dp_size: int,
    ) -> torch.Tensor: ...


class PairLossFn(Protocol):
    """Per-pair reward-model loss ``[P]`` from chosen and rejected scores (``margin=`` when given)."""

    def __call__(self, chosen: torch.Tensor, rejected: torch.Tensor, **kw: Any) -> torch.Tensor: ...


class DPOLossFn(Protocol):
    """Per-pair preference loss ``[P]`` (a tensor or a result with ``.loss``) from summed log-probs."""

    def __call__(
        self,
        chosen_logp: torch.Tensor,
        rejected_logp: torch.Tensor,
        ref_chosen_logp: torch.Tensor,
        ref_rejected_logp: torch.Tensor,
    ) -> Any: ...


class KTOLossFn(Protocol):
    """Per-example KTO loss ``[N]``."""

    def __call__(
        self,
        policy_logp: torch.Tensor,
        ref_logp: torch.Tensor,
        desirable: torch.Tensor,
        kl_baseline: torch.Tensor,
    ) -> torch.Tensor: ...


class KLBaselineFn(Protocol):
    """KTO's reference point (a scalar) from the mismatched rows' policy and reference log-probs."""

    def __call__(self, policy_kl_logp: torch.Tensor, ref_kl_logp: torch.Tensor) -> torch.Tensor: ...


class DivergenceFn(Protocol):
    """Per-token divergence ``[N]`` of the student's distribution from the teacher's, each given as
    ``[N, K]`` log-probs of the same K tokens (the student's normalised over the whole vocabulary)."""

    def __call__(self, student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor: ...
