"""``rlhf distill``: offline knowledge distillation. The student (``--model``) learns the teacher's
next-token distribution at every response token of a prompt + response data set; the teacher runs as its
own frozen group, scoring each step's examples, or scores every example once (``--teacher.precompute``),
after which its group stops."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlhf_cli.config import DistillConfig
from rlhf_cli.data.batches import TeacherTargets, distill_batch
from rlhf_cli.data.examples import Example, load_sft
from rlhf_cli.offline.reference import SCORING_CHUNK
from rlhf_cli.offline.trainer import Groups, OfflineResult, offline_plan, run_command
from rlhf_cli.runtime.learners.specs import DistillSettings
from rlhf_cli.runtime.plan.placement import Plan
from rlhf_cli.runtime.runs.tracking import Display

__all__ = ["DISTILL_DISPLAY", "TaughtExample", "plan", "run"]

DISTILL_DISPLAY = Display(
    name="distill",
    shown=(
        ("loss", "train/loss", "{:.4f}"),
        ("eval divergence", "eval/divergence", "{:.4f}"),
        ("eval nll", "eval/nll", "{:.3f}"),
    ),
    curves={
        "train/loss": ("train divergence (per response token)", {"alpha": 0.7}),
        "eval/divergence": ("eval divergence", {"marker": "o", "linewidth": 2.5}),
    },
    curve_file="loss_curve.png",
    lower_is_better=("loss", "divergence", "nll", "time"),
    summary_keys=("train/loss", "train/nll", "eval/divergence", "eval/nll", "time/teacher", "time/step"),
)


@dataclass(frozen=True, kw_only=True)
class TaughtExample:
    """A training or evaluation example and, once the teacher has scored it, its targets."""

    example: Example
    targets: TeacherTargets | None = None


@dataclass
class DistillObjective:
    cfg: DistillConfig
    groups: Groups
    display: Display = DISTILL_DISPLAY
    vocab: int | None = field(default=None)
    """The student's vocabulary (its logits): a teacher with a padded embedding is cut to it."""

    @property
    def settings(self) -> DistillSettings:
        return DistillSettings(loss=self.cfg.algo.loss, beta=self.cfg.algo.beta)

    def _taught(self, items: list[TaughtExample]) -> list[TaughtExample]:
        """``items`` with the teacher's targets filled in (those that have them are kept)."""
        todo = [i for i, x in enumerate(items) if x.targets is None]
        if not todo:
            return items
        teacher = self.groups.ref
        if teacher is None:
            raise RuntimeError("teacher targets are missing and the teacher group was stopped")
        found: list[TeacherTargets] = []
        for lo in range(0, len(todo), SCORING_CHUNK):
            chunk = [items[i].example for i in todo[lo : lo + SCORING_CHUNK]]
            found += teacher.submit_teacher_targets(
                [e.token_ids for e in chunk],
                [e.loss_mask for e in chunk],
                micro_batch_size=self.cfg.train.micro_batch_size,
                top_k=self.cfg.algo.top_k,
                vocab=self.vocab,
            )()
            if len(todo) > SCORING_CHUNK:
                print(f"teacher: scored {len(found)}/{len(todo)} examples", file=sys.stderr)
        out = list(items)
        for i, targets in zip(todo, found, strict=True):
            out[i] = replace(items[i], targets=targets)
        return out

    def prepare(
        self, train: list[Example], evals: list[Example]
    ) -> tuple[list[TaughtExample], list[TaughtExample]]:
        """The evaluation examples are scored by the teacher once, here; the training examples too with
        ``--teacher.precompute``, after which its group stops."""
        taught = [TaughtExample(example=e) for e in train]
        held_out = self._taught([TaughtExample(example=e) for e in evals])
        if self.cfg.teacher.precompute:
            taught = self._taught(taught)
            self.groups.stop_ref()
        return taught, held_out

    def step(self, per_rank: Sequence[Sequence[Sequence[TaughtExample]]]) -> dict[str, float]:
        t0 = time.perf_counter()
        flat = iter(self._taught([x for mbs in per_rank for mb in mbs for x in mb]))
        teacher_s = time.perf_counter() - t0
        packing = self.cfg.train.packing
        batches = []
        for mbs in per_rank:
            batches.append([])
            for mb in mbs:
                items = [next(flat) for _ in mb]
                ids, masks = [x.example.token_ids for x in items], [x.example.loss_mask for x in items]
                targets = [x.targets for x in items]
                batches[-1].append(distill_batch(ids, masks, targets, packing=packing)[0])  # type: ignore[arg-type]
        res = self.groups.model.train_distill(batches, settings=self.settings)
        return {
            "train/loss": res.loss,
            "train/nll": res.metrics["nll"],
            "train/grad_norm": res.grad_norm if res.grad_norm is not None else math.nan,
            "time/teacher": teacher_s,
        }

    def evaluate(self, examples: list[TaughtExample]) -> dict[str, float]:
        """The divergence per response token from the teacher (the training loss's definition), and the
        student's NLL of the responses."""
        mbs = self.cfg.train.micro_batch_size
        seqs = [x.example.token_ids for x in examples]
        sums = self.groups.model.distill_divergences(
            seqs,
            [(x.example.loss_mask, x.targets) for x in examples],
            micro_batch_size=mbs,
            settings=self.settings,
        )
        logp = self.groups.model.forward(seqs, micro_batch_size=mbs, packing=True)
        nll = sum(float(-(lp * x.example.loss_mask).sum()) for lp, x in zip(logp, examples, strict=True))
        tokens = max(1, sum(n for _, n in sums))
        return {"eval/divergence": sum(d for d, _ in sums) / tokens, "eval/nll": nll / tokens}

    def finish(self, train: list[TaughtExample]) -> None:
        pass


def _loader(cfg: DistillConfig) -> Callable[[Path, Any, str], list]:
    """How ``--data.path`` / ``--eval.path`` are read (by the run, and by ``--dry-run``)."""

    def load(path: Path, tokenizer: Any, flag: str, encoder: Any = None) -> list:
        if encoder is not None:
            raise ValueError(
                "rlhf distill: not for vision-language models yet (rlhf sft, dpo and ppo take images)"
            )
        return load_sft(path, tokenizer, cfg.data, flag=flag)

    return load


def plan(cfg: DistillConfig) -> Plan:
    return offline_plan(cfg, with_ref=True, load=_loader(cfg))


def run(cfg: DistillConfig) -> OfflineResult:
    return run_command(
        cfg,
        role="actor",
        builtin="sft",
        load=_loader(cfg),
        make_objective=lambda groups: DistillObjective(cfg, groups, vocab=groups.model.spec.text_vocab),
        with_ref=True,
    )
