"""``rlhf dpo``: DPO / IPO / cDPO against a frozen reference (its own group, or precomputed once)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_algos import dpo_loss
from rlhf_cli.config import DPOConfig
from rlhf_cli.data.batches import dpo_batch
from rlhf_cli.data.examples import PreferencePair, load_pairs
from rlhf_cli.offline.reference import ReferenceObjective
from rlhf_cli.offline.trainer import Groups, OfflineResult, offline_plan, run_command
from rlhf_cli.runtime.learners.specs import DPOSettings
from rlhf_cli.runtime.plan.placement import Plan
from rlhf_cli.runtime.runs.tracking import Display

__all__ = ["DPO_DISPLAY", "plan", "run"]

DPO_DISPLAY = Display(
    name="dpo",
    shown=(
        ("loss", "train/loss", "{:.4f}"),
        ("reward acc", "train/reward_accuracy", "{:.2f}"),
        ("eval reward acc", "eval/reward_accuracy", "{:.2f}"),
    ),
    curves={
        "train/loss": ("train loss", {"alpha": 0.7}),
        "train/reward_accuracy": ("train reward accuracy", {"alpha": 0.5}),
        "eval/reward_accuracy": ("eval reward accuracy", {"marker": "o", "linewidth": 2.5}),
        "eval/reward_margin": ("eval reward margin", {"marker": "x", "linestyle": "--"}),
    },
    curve_file="loss_curve.png",
    summary_keys=(
        "train/loss",
        "train/reward_accuracy",
        "train/reward_margin",
        "eval/loss",
        "eval/reward_accuracy",
        "eval/reward_margin",
        "time/step",
    ),
)


@dataclass
class DPOObjective(ReferenceObjective[PreferencePair]):
    cfg: DPOConfig
    groups: Groups
    display: Display = DPO_DISPLAY

    def step(self, per_rank: Sequence[Sequence[Sequence[PreferencePair]]]) -> dict[str, float]:
        batches = [[dpo_batch(pairs, ref_logp=ref) for pairs, ref in mbs] for mbs in self._with_ref(per_rank)]
        a = self.cfg.algo
        settings = DPOSettings(
            loss=a.loss, beta=a.beta, label_smoothing=a.label_smoothing, nll_coef=a.nll_coef
        )
        res = self.groups.model.train_dpo(batches, settings=settings)
        return {
            "train/loss": res.loss,
            "train/reward_accuracy": res.metrics["accuracy"],
            "train/reward_margin": a.beta * res.metrics["logit_margin"],
            "train/grad_norm": res.grad_norm if res.grad_norm is not None else math.nan,
        }

    def evaluate(self, examples: list[PreferencePair]) -> dict[str, float]:
        """The loss, and the implicit rewards ``beta * (log pi - log pi_ref)``: how often the chosen
        response's exceeds the rejected one's (reward accuracy) and by how much (margin)."""
        chosen, rejected, ref_chosen, ref_rejected = self._logps(examples)
        a = self.cfg.algo
        out = dpo_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            beta=a.beta,
            variant=a.loss,
            label_smoothing=a.label_smoothing,
        )
        margin = out.chosen_rewards - out.rejected_rewards
        return {
            "eval/loss": float(out.loss.mean()),
            "eval/reward_accuracy": float((margin > 0).float().mean()),
            "eval/reward_margin": float(margin.mean()),
        }


def _loader(cfg: DPOConfig) -> Callable[[Path, Any, str], list]:
    """How ``--data.path`` / ``--eval.path`` are read (by the run, and by ``--dry-run``)."""
    return lambda path, tokenizer, flag, encoder=None: load_pairs(
        path, tokenizer, cfg.data, flag=flag, encoder=encoder
    )


def plan(cfg: DPOConfig) -> Plan:
    return offline_plan(cfg, with_ref=True, load=_loader(cfg))


def run(cfg: DPOConfig) -> OfflineResult:
    return run_command(
        cfg,
        role="actor",
        builtin="preferences",
        load=_loader(cfg),
        make_objective=lambda groups: DPOObjective(cfg, groups),
        with_ref=True,
    )
