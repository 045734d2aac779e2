"""``rlhf kto``: Kahneman-Tversky optimisation on unpaired desirable / undesirable examples."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rlhf_algos import kto_kl_baseline, kto_loss
from rlhf_cli.config import KTOConfig
from rlhf_cli.data.batches import kto_batch
from rlhf_cli.data.examples import KTOExample, load_kto
from rlhf_cli.offline.reference import ReferenceObjective
from rlhf_cli.offline.trainer import Groups, OfflineResult, offline_plan, run_command
from rlhf_cli.runtime.learners.specs import KTOSettings
from rlhf_cli.runtime.plan.placement import Plan
from rlhf_cli.runtime.runs.tracking import Display

__all__ = ["KTO_DISPLAY", "plan", "run"]

KTO_DISPLAY = Display(
    name="kto",
    shown=(("loss", "train/loss", "{:.4f}"), ("eval gap", "eval/reward_gap", "{:.3f}")),
    curves={
        "train/loss": ("train loss", {"alpha": 0.7}),
        "eval/reward_desirable": ("eval reward, desirable", {"marker": "o"}),
        "eval/reward_undesirable": ("eval reward, undesirable", {"marker": "x"}),
    },
    curve_file="loss_curve.png",
    lower_is_better=("loss", "time", "undesirable"),
    summary_keys=(
        "train/loss",
        "train/kl_baseline",
        "eval/loss",
        "eval/reward_desirable",
        "eval/reward_undesirable",
        "eval/reward_gap",
        "time/step",
    ),
)


@dataclass
class KTOObjective(ReferenceObjective[KTOExample]):
    cfg: KTOConfig
    groups: Groups
    display: Display = KTO_DISPLAY

    def step(self, per_rank: Sequence[Sequence[Sequence[KTOExample]]]) -> dict[str, float]:
        batches = [[kto_batch(items, ref_logp=ref) for items, ref in mbs] for mbs in self._with_ref(per_rank)]
        a = self.cfg.algo
        settings = KTOSettings(
            beta=a.beta, desirable_weight=a.desirable_weight, undesirable_weight=a.undesirable_weight
        )
        res = self.groups.model.train_kto(batches, settings=settings)
        return {
            "train/loss": res.loss,
            "train/kl_baseline": res.metrics["kl_baseline"],
            "train/grad_norm": res.grad_norm if res.grad_norm is not None else math.nan,
        }

    def evaluate(self, examples: list[KTOExample]) -> dict[str, float]:
        """The loss and the implicit rewards ``beta * (log pi - log pi_ref)`` of desirable and
        undesirable responses; training should raise the first and lower the second (their gap)."""
        logp, kl_logp, ref, ref_kl = self._logps(examples)
        desirable = torch.tensor([e.desirable for e in examples])
        a = self.cfg.algo
        z0 = kto_kl_baseline(kl_logp, ref_kl)
        loss = kto_loss(
            logp,
            ref,
            desirable,
            z0,
            beta=a.beta,
            desirable_weight=a.desirable_weight,
            undesirable_weight=a.undesirable_weight,
        )
        reward = a.beta * (logp - ref)
        good = float(reward[desirable].mean()) if desirable.any() else math.nan
        bad = float(reward[~desirable].mean()) if (~desirable).any() else math.nan
        return {
            "eval/loss": float(loss.mean()),
            "eval/reward_desirable": good,
            "eval/reward_undesirable": bad,
            "eval/reward_gap": good - bad,
        }


def _loader(cfg: KTOConfig) -> Callable[[Path, Any, str], list]:
    """How ``--data.path`` / ``--eval.path`` are read (by the run, and by ``--dry-run``)."""

    def load(path, tokenizer, flag, encoder=None):
        if encoder is not None:
            raise ValueError("rlhf kto: not for vision-language models (rlhf sft, dpo and ppo take images)")
        return load_kto(path, tokenizer, cfg.data, seed=cfg.train.seed, flag=flag)

    return load


def plan(cfg: KTOConfig) -> Plan:
    return offline_plan(cfg, with_ref=True, load=_loader(cfg))


def run(cfg: KTOConfig) -> OfflineResult:
    return run_command(
        cfg,
        role="actor",
        builtin="kto",
        load=_loader(cfg),
        make_objective=lambda groups: KTOObjective(cfg, groups),
        with_ref=True,
    )
