"""``rlhf rm``: a pairwise (Bradley-Terry) reward model; the export stores its score normalisation."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rlhf_cli.config import RMConfig
from rlhf_cli.data.batches import reward_batch
from rlhf_cli.data.examples import PreferencePair, load_pairs
from rlhf_cli.offline.trainer import Groups, OfflineResult, offline_plan, run_command
from rlhf_cli.runtime.plan.placement import Plan
from rlhf_cli.runtime.runs.tracking import Display

__all__ = ["NORMALIZATION_SAMPLES", "RM_DISPLAY", "plan", "run"]

RM_DISPLAY = Display(
    name="rm",
    shown=(
        ("loss", "train/loss", "{:.4f}"),
        ("acc", "train/accuracy", "{:.2f}"),
        ("eval acc", "eval/accuracy", "{:.2f}"),
    ),
    curves={
        "train/loss": ("train loss", {"alpha": 0.7}),
        "train/accuracy": ("train accuracy", {"alpha": 0.5}),
        "eval/accuracy": ("eval accuracy (chosen scored above rejected)", {"marker": "o", "linewidth": 2.5}),
    },
    curve_file="loss_curve.png",
    summary_keys=("train/loss", "train/accuracy", "eval/accuracy", "eval/margin", "time/step"),
)

NORMALIZATION_SAMPLES = 1024
"""Pairs whose scores set the saved normalisation (mean and std of chosen and rejected scores)."""


@dataclass
class RMObjective:
    cfg: RMConfig
    groups: Groups
    display: Display = RM_DISPLAY

    def prepare(
        self, train: list[PreferencePair], evals: list[PreferencePair]
    ) -> tuple[list[PreferencePair], list[PreferencePair]]:
        return train, evals

    def step(self, per_rank: Sequence[Sequence[Sequence[PreferencePair]]]) -> dict[str, float]:
        res = self.groups.model.train_reward_model([[reward_batch(mb) for mb in mbs] for mbs in per_rank])
        return {
            "train/loss": res.loss,
            "train/accuracy": res.metrics["accuracy"],
            "train/margin": res.metrics["margin"],
            "train/grad_norm": res.grad_norm if res.grad_norm is not None else math.nan,
        }

    def _scores(self, pairs: Sequence[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = [p.chosen.token_ids for p in pairs] + [p.rejected.token_ids for p in pairs]
        s = torch.stack(
            self.groups.model.forward(seqs, micro_batch_size=self.cfg.train.micro_batch_size, packing=False)
        )
        return s[: len(pairs)], s[len(pairs) :]

    def evaluate(self, examples: list[PreferencePair]) -> dict[str, float]:
        chosen, rejected = self._scores(examples)
        return {
            "eval/accuracy": float((chosen > rejected).float().mean()),
            "eval/margin": float((chosen - rejected).mean()),
        }

    def finish(self, train: list[PreferencePair]) -> None:
        """Scores of the training responses -> mean / std stored in the model's config."""
        chosen, rejected = self._scores(train[:NORMALIZATION_SAMPLES])
        scores = torch.cat([chosen, rejected])
        std = float(scores.std()) if scores.numel() > 1 else 1.0
        self.groups.model.set_reward_normalization(mean=float(scores.mean()), std=std if std > 1e-6 else 1.0)


def _loader(cfg: RMConfig) -> Callable[[Path, Any, str], list]:
    """How ``--data.path`` / ``--eval.path`` are read (by the run, and by ``--dry-run``)."""

    def load(path, tokenizer, flag, encoder=None):
        if encoder is not None:
            raise ValueError("rlhf rm: not for vision-language models (rlhf sft, dpo and ppo take images)")
        return load_pairs(path, tokenizer, cfg.data, flag=flag)

    return load


def plan(cfg: RMConfig) -> Plan:
    return offline_plan(cfg, with_ref=False, load=_loader(cfg))


def run(cfg: RMConfig) -> OfflineResult:
    return run_command(
        cfg,
        role="reward",
        builtin="preferences",
        load=_loader(cfg),
        make_objective=lambda groups: RMObjective(cfg, groups),
        with_ref=False,
    )
