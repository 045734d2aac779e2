"""A training engine small enough to check a loss and its gradient against formulas written out by
hand: a bigram policy (one float64 table) with what rlhf-learner's step functions need of an engine."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["BigramEngine", "EngineOutput"]


class EngineOutput(NamedTuple):
    logp: torch.Tensor
    entropy: torch.Tensor | None
    aux_loss: torch.Tensor | None


class BigramEngine(torch.nn.Module):
    """What ``ppo_actor_step`` needs of a training engine (``rlhf_learner.TrainEngine``): a call giving
    per-token log-probs, ``backward`` and ``step``. ``step`` only counts, leaving the weights alone, so
    the summed gradient of the whole window stays in ``.grad`` to compare."""

    def __init__(self, vocab: int, *, gas: int = 1, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g, dtype=torch.float64))
        self.gas, self.device, self.steps = gas, torch.device("cpu"), 0

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_) -> EngineOutput:
        return EngineOutput(logp=self.logp(input_ids), entropy=None, aux_loss=None)

    def logp(self, ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]``: log-prob of token ``t`` given token ``t - 1``; column 0 predicts nothing (0)."""
        logsm = torch.log_softmax(self.table[ids[:, :-1]], dim=-1)
        picked = logsm.gather(-1, ids[:, 1:, None]).squeeze(-1)
        return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        assert scale_wrt_gas is False, "the step functions scale the loss themselves"
        loss.backward()

    def step(self) -> None:
        self.steps += 1
