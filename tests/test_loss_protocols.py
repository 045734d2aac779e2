"""rlhf-algos' losses, as the CLI hands them to rlhf-learner's steps, accept every argument the steps'
loss Protocols pass (so a step never calls a loss with arguments it does not take)."""

from __future__ import annotations

import functools
import inspect

import pytest
import rlhf_algos as A
from rlhf_learner import steps as S

CASES = [
    (
        S.PolicyLossFn,
        functools.partial(A.policy_loss, clip_eps_low=0.2),
        {"is_weights": 1, "entropy": 1, "entropy_coef": 0.1},
    ),
    (S.AggregateFn, functools.partial(A.aggregate_loss, mode="token-mean"), {}),
    (S.KLLossFn, functools.partial(A.approx_kl, estimator="k3"), {}),
    (S.ISWeightsFn, functools.partial(A.vllm_is_weights, mode="tis", low=0.5, high=2.0), {}),
    (S.ValueLossFn, functools.partial(A.value_loss, clip_eps=0.2), {}),
    (S.SFTLossFn, A.sft_loss, {}),
    (S.PairLossFn, A.pairwise_rm_loss, {"margin": 0.0}),
    (S.DPOLossFn, functools.partial(A.dpo_loss, beta=0.1), {}),
    (S.KTOLossFn, functools.partial(A.kto_loss, beta=0.1), {}),
    (S.KLBaselineFn, A.kto_kl_baseline, {}),
]


@pytest.mark.parametrize(("protocol", "fn", "extra"), CASES, ids=lambda x: getattr(x, "__name__", ""))
def test_algos_loss_takes_what_the_step_passes(protocol, fn, extra):
    params = inspect.signature(protocol.__call__).parameters
    positional = [p for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][1:]
    keyword = {p.name: 1 for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    inspect.signature(fn).bind(*range(len(positional)), **keyword, **extra)  # raises TypeError on a mismatch
