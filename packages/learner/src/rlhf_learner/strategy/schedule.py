"""Learning-rate schedules stepped once per optimizer step: linear warmup, then constant, linear or
cosine decay to a floor."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = ["LRSchedule", "SchedulerName", "lr_factor", "make_lr_scheduler"]

SchedulerName = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """``kind`` after ``warmup_steps`` of linear warmup, over ``total_steps`` optimizer steps in all,
    down to ``min_lr_ratio`` x the peak learning rate (linear and cosine)."""

    kind: SchedulerName = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    """Optimizer steps of the whole run (linear and cosine need it)."""
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in get_args(SchedulerName):
            raise ValueError(f"lr_scheduler: expected one of {get_args(SchedulerName)}, got {self.kind!r}")
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ValueError("lr_scheduler: warmup and total steps must be >= 0")
        if self.kind != "constant" and self.total_steps < 1:
            raise ValueError(f"lr_scheduler {self.kind}: needs the run's total optimizer steps")
        if self.kind != "constant" and self.warmup_steps >= self.total_steps:
            raise ValueError(
                f"lr_scheduler {self.kind}: {self.warmup_steps} warmup steps leave none of the run's "
                f"{self.total_steps} optimizer steps to decay over"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: expected a value in [0, 1], got {self.min_lr_ratio}")

    @property
    def is_identity(self) -> bool:
        """Constant with no warmup: the optimizer's learning rate as it is."""
        return self.kind == "constant" and self.warmup_steps == 0


def lr_factor(step: int, schedule: LRSchedule) -> float:
    """The multiplier of the peak learning rate for optimizer step ``step`` (0-based: the first update
    uses ``lr_factor(0)``).

    Warmup (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): ``(step + 1) / W`` for ``step < W``.
    After it, with ``p = (step - W) / max(1, T - W)`` clamped to [0, 1] and floor ``m``:
    constant ``1``; linear ``m + (1 - m)(1 - p)``; cosine (Loshchilov & Hutter 2017, "SGDR")
    ``m + (1 - m)(1 + cos(pi p)) / 2``.
    """
    w = schedule.warmup_steps
    if step < w:
        return (step + 1) / w
    if schedule.kind == "constant":
        return 1.0
    p = min(1.0, max(0.0, (step - w) / max(1, schedule.total_steps - w)))
    m = schedule.min_lr_ratio
    if schedule.kind == "linear":
        return m + (1 - m) * (1 - p)
    return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p))


def make_lr_scheduler(optimizer: Any, schedule: LRSchedule) -> Any:
    """A torch ``LambdaLR`` over ``optimizer`` following ``schedule`` (its state, the step count, goes
    into checkpoints with the optimizer's)."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, schedule))
