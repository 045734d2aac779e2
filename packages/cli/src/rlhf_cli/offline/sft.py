"""``rlhf sft``: supervised fine-tuning, the loss on the response tokens, packed rows, optional LoRA."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_cli.config import SFTConfig
from rlhf_cli.data.batches import sft_batch_from_examples
from rlhf_cli.data.examples import Example, load_sft
from rlhf_cli.offline.reference import SCORING_CHUNK
from rlhf_cli.offline.trainer import Groups, OfflineResult, offline_plan, run_command
from rlhf_cli.runtime.plan.placement import Plan
from rlhf_cli.runtime.runs.tracking import Display

__all__ = ["SFT_DISPLAY", "plan", "run"]

SFT_DISPLAY = Display(
    name="sft",
    shown=(("loss", "train/loss", "{:.4f}"), ("eval loss", "eval/loss", "{:.4f}")),
    curves={
        "train/loss": ("train loss (NLL per response token)", {"alpha": 0.7}),
        "eval/loss": ("eval loss", {"marker": "o", "linewidth": 2.5}),
    },
    curve_file="loss_curve.png",
    summary_keys=("train/loss", "eval/loss", "train/grad_norm", "time/step"),
)


@dataclass
class SFTObjective:
    cfg: SFTConfig
    groups: Groups
    display: Display = SFT_DISPLAY

    def prepare(self, train: list[Example], evals: list[Example]) -> tuple[list[Example], list[Example]]:
        return train, evals

    def step(self, per_rank: Sequence[Sequence[Sequence[Example]]]) -> dict[str, float]:
        packing = self.cfg.train.packing
        res = self.groups.model.train_sft(
            [[sft_batch_from_examples(mb, packing=packing) for mb in mbs] for mbs in per_rank]
        )
        return {
            "train/loss": res.loss,
            "train/grad_norm": res.grad_norm if res.grad_norm is not None else math.nan,
        }

    def evaluate(self, examples: list[Example]) -> dict[str, float]:
        """Token-mean NLL of the evaluation responses (the training loss's definition), scored in chunks
        of ``SCORING_CHUNK`` examples (an image example's pixels are made for its chunk)."""
        logp: list = []
        for lo in range(0, len(examples), SCORING_CHUNK):
            chunk = [e.scored for e in examples[lo : lo + SCORING_CHUNK]]
            logp += self.groups.model.forward(
                chunk, micro_batch_size=self.cfg.train.micro_batch_size, packing=True
            )
        nll = sum(float(-(lp * e.loss_mask).sum()) for lp, e in zip(logp, examples, strict=True))
        return {"eval/loss": nll / max(1, sum(int(e.loss_mask.sum()) for e in examples))}

    def finish(self, train: list[Example]) -> None:
        pass


def _loader(cfg: SFTConfig) -> Callable[[Path, Any, str], list]:
    """How ``--data.path`` / ``--eval.path`` are read (by the run, and by ``--dry-run``)."""
    return lambda path, tokenizer, flag, encoder=None: load_sft(
        path, tokenizer, cfg.data, flag=flag, encoder=encoder
    )


def plan(cfg: SFTConfig) -> Plan:
    return offline_plan(cfg, with_ref=False, load=_loader(cfg))


def run(cfg: SFTConfig) -> OfflineResult:
    return run_command(
        cfg,
        role="actor",
        builtin="sft",
        load=_loader(cfg),
        make_objective=lambda groups: SFTObjective(cfg, groups),
        with_ref=False,
    )
