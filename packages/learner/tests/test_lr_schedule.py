"""Learning-rate schedules: ``lr_factor`` against closed forms written out here, a real DeepSpeed
engine (one rank, CPU, gloo) following them once per optimizer step, and a checkpoint resume that
continues the schedule where it stopped."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from rlhf_algos import sft_loss
from rlhf_learner.models import Actor, load_causal_lm
from rlhf_learner.steps import SFTBatch, sft_step
from rlhf_learner.strategy import LRSchedule, Strategy, StrategyOptions, lr_factor, make_lr_scheduler

LR = 1e-3


def closed_form(step: int, kind: str, *, warmup: int = 0, total: int = 0, floor: float = 0.0) -> float:
    """Linear warmup ``(step + 1) / warmup`` (the first update already moves), then over the remaining
    ``total - warmup`` steps: constant 1; linear from 1 down to ``floor``; half a cosine period from 1
    down to ``floor``; ``floor`` from step ``total`` on."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    done = min(1.0, (step - warmup) / (total - warmup))
    if kind == "linear":
        return 1.0 - (1.0 - floor) * done
    return floor + (1.0 - floor) * (math.cos(math.pi * done) + 1.0) / 2.0


# ---------------------------------------------------------------------------------------------------
# a. lr_factor


@pytest.mark.parametrize(
    ("kind", "warmup", "total", "floor"),
    [
        ("constant", 0, 0, 0.0),
        ("constant", 3, 0, 0.0),
        ("constant", 3, 10, 0.5),  # floor and total do not matter for constant
        ("linear", 0, 10, 0.0),
        ("linear", 4, 10, 0.0),
        ("linear", 4, 10, 0.2),
        ("cosine", 0, 10, 0.0),
        ("cosine", 2, 8, 0.1),
        ("cosine", 5, 25, 0.3),
    ],
)
def test_lr_factor_is_the_closed_form(kind, warmup, total, floor):
    schedule = LRSchedule(kind=kind, warmup_steps=warmup, total_steps=total, min_lr_ratio=floor)
    for step in range(0, max(total, warmup) + 6):  # past the end of the run too
        want = closed_form(step, kind, warmup=warmup, total=total, floor=floor)
        assert lr_factor(step, schedule) == pytest.approx(want, rel=1e-12, abs=1e-15), step
    assert schedule.is_identity == (kind == "constant" and warmup == 0)


def test_lr_factor_known_values():
    cos = LRSchedule(kind="cosine", warmup_steps=2, total_steps=8, min_lr_ratio=0.1)
    values = [lr_factor(s, cos) for s in range(12)]
    # warmup 1/2, 2/2; then p = 0, 1/6, ..., 1; the middle (p = 1/2, step 5) is halfway to the floor
    assert values[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert values[5] == pytest.approx(0.1 + 0.9 * 0.5)
    assert values[3] == pytest.approx(0.1 + 0.45 * (1 + math.sqrt(3) / 2))
    assert values[8:] == pytest.approx([0.1] * 4)
    assert all(a >= b for a, b in itertools.pairwise(values[1:]))  # never rises after warmup
    lin = LRSchedule(kind="linear", total_steps=4)
    assert [lr_factor(s, lin) for s in range(7)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0])
    lin_floor = LRSchedule(kind="linear", warmup_steps=1, total_steps=5, min_lr_ratio=0.2)
    assert [lr_factor(s, lin_floor) for s in range(7)] == pytest.approx([1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    const = LRSchedule(kind="constant", warmup_steps=4)
    assert [lr_factor(s, const) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_make_lr_scheduler_steps_a_torch_optimizer_through_the_factors():
    schedule = LRSchedule(kind="cosine", warmup_steps=3, total_steps=10, min_lr_ratio=0.05)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.4)
    sched = make_lr_scheduler(opt, schedule)
    for step in range(14):  # the lr the update of optimizer step ``step`` uses
        want = 0.4 * closed_form(step, "cosine", warmup=3, total=10, floor=0.05)
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12), step
        opt.step()
        sched.step()


# ---------------------------------------------------------------------------------------------------
# b/c. a real DeepSpeed engine

COSINE = LRSchedule(kind="cosine", warmup_steps=2, total_steps=8, min_lr_ratio=0.1)


def expected_lr(step: int) -> float:
    return LR * closed_form(step, "cosine", warmup=2, total=8, floor=0.1)


def _batch(seed: int = 0) -> SFTBatch:
    ids = torch.randint(3, 400, (2, 8), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[:, :2] = False
    return SFTBatch(input_ids=ids, attention_mask=torch.ones(2, 8, dtype=torch.long), loss_mask=mask)


def _strategy(stage: int, schedule: LRSchedule | None = COSINE) -> Strategy:
    kw = {} if schedule is None else {"lr_schedule": schedule}
    return Strategy(StrategyOptions(lr=LR, zero_stage=stage, grad_accum_steps=1, **kw))


def _lrs(engine) -> set[float]:
    """Every learning rate the engine and its wrapped torch optimizer hold now."""
    groups = list(engine.optimizer.param_groups) + list(engine.basic_optimizer.param_groups)
    return {float(g["lr"]) for g in groups} | {float(x) for x in engine.get_lr()}


def _only_lr(engine) -> float:
    (lr,) = _lrs(engine)
    return lr


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _train(engine, steps: range, expected) -> list[float]:
    """Step ``engine`` once per entry of ``steps``, checking before each that it holds ``expected(step)``."""
    losses = []
    for step in steps:
        assert _only_lr(engine) == pytest.approx(expected(step), rel=1e-12), step
        losses.append(sft_step(engine, [_batch(step)], sft_loss_fn=sft_loss).loss)
    return losses


@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_engine_follows_the_schedule(dist_single, tiny_model_dir, stage):
    engine = _strategy(stage).prepare(Actor(load_causal_lm(tiny_model_dir)))
    assert engine.lr_scheduler is not None
    # the first update is AdamW's first step: |delta| = lr * |g| / (|g| + eps), lr * f(0) for the
    # largest gradients; so the optimizer really uses the scheduled learning rate, not the peak
    before = _params(engine)
    _train(engine, range(1), expected_lr)
    moved = max(float((a - b).abs().max()) for a, b in zip(_params(engine), before, strict=True))
    assert moved == pytest.approx(expected_lr(0), rel=1e-3)
    assert expected_lr(0) == pytest.approx(LR / 2)
    _train(engine, range(1, 8), expected_lr)
    assert _only_lr(engine) == pytest.approx(LR * 0.1)  # step 8: past the run, at the floor


@pytest.mark.parametrize("stage", [0, 2])
def test_resume_continues_the_schedule(dist_single, tiny_model_dir, tmp_path, stage):
    strategy = _strategy(stage)
    first = strategy.prepare(Actor(load_causal_lm(tiny_model_dir)))
    _train(first, range(3), expected_lr)
    strategy.save_checkpoint(first, tmp_path / "ckpt", tag="step3", client_state={"step": 3})
    rest_uninterrupted = _train(first, range(3, 8), expected_lr)

    strategy2 = _strategy(stage)
    second = strategy2.prepare(Actor(load_causal_lm(tiny_model_dir)))
    assert _only_lr(second) == pytest.approx(expected_lr(0))  # a fresh engine starts at step 0
    assert strategy2.load_checkpoint(second, tmp_path / "ckpt") == {"step": 3}
    assert second.lr_scheduler.last_epoch == 3
    rest_resumed = _train(second, range(3, 8), expected_lr)
    # same weights, optimizer state and learning rates: the same losses as without the interruption
    assert rest_resumed == pytest.approx(rest_uninterrupted, rel=1e-5)
    assert _only_lr(second) == pytest.approx(LR * 0.1)


def test_engine_without_a_schedule_keeps_its_learning_rate(dist_single, tiny_model_dir, tmp_path):
    strategy = _strategy(0, schedule=None)
    assert strategy.options.lr_schedule.is_identity
    engine = strategy.prepare(Actor(load_causal_lm(tiny_model_dir)))
    assert engine.lr_scheduler is None
    _train(engine, range(3), lambda step: LR)
    strategy.save_checkpoint(engine, tmp_path / "ckpt", tag="step3")
    again = strategy.prepare(Actor(load_causal_lm(tiny_model_dir)))
    strategy.load_checkpoint(again, tmp_path / "ckpt")
    assert again.lr_scheduler is None
    _train(again, range(3, 6), lambda step: LR)
