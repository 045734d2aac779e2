"""``rlhf distill`` through the real stack (Ray, DeepSpeed student and teacher groups) on tiny models:
each divergence brings the student closer to a larger teacher on held-out examples; the teacher's top k of
the whole vocabulary, precomputed once, gives the run the teacher group gives; a run killed at its
teacher's rank resumes, teacher restarted, to the uninterrupted run; bad input is refused in one line
before start-up. Runs share the session's Ray cluster."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from rlhf_cli.config import DistillConfig, build_config
from rlhf_cli.demo import task
from rlhf_cli.main import app
from rlhf_cli.offline import distill
from rlhf_testkit import SocketWatcher, TinyModelSpec, build_tiny_model
from rlhf_testkit.commands import (
    Driver,
    kill_steps_rng,
    ray_workers,
    rows,
    same_weights,
    training_metrics,
)
from typer.testing import CliRunner

QUIET = ["--logger.progress", "false", "--logger.tensorboard", "false"]
TEACHER = TinyModelSpec(num_hidden_layers=3, hidden_size=192, intermediate_size=384, seed=0)
"""Larger than the student (the demo's model), with its tokenizer (the same vocabulary and seed)."""


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("teacher"), TEACHER)


@pytest.fixture(scope="module")
def flags(demo_model_dir, teacher_dir, tmp_path_factory) -> list[str]:
    data = task.write_data("sft", tmp_path_factory.mktemp("distill_data") / "sft.jsonl", seed=0)
    return [
        *("--model.pretrain", str(demo_model_dir), "--teacher.pretrain", str(teacher_dir)),
        *("--data.path", str(data), "--train.batch_size", "16", "--train.micro_batch_size", "8"),
        *("--train.num_steps", "6", "--eval.every", "6", "--train.seed", "3", "--model.lr", "3e-3", *QUIET),
    ]


def _run(flags: list[str], run_dir: Path, *more: str):
    return distill.run(build_config(DistillConfig, [*flags, "--logger.run_dir", str(run_dir), *more]))


@pytest.mark.slow
def test_each_divergence_brings_the_student_closer_to_its_teacher(ray_cluster, flags, tmp_path):
    """Forward KL, reverse KL, and JSD over the teacher's top 8 (plus the rest): the held-out divergence
    falls. Every socket the last run's processes listen on is loopback."""
    for loss, more in (("forward_kl", ()), ("reverse_kl", ()), ("jsd", ("--algo.top_k", "8"))):
        with (
            SocketWatcher(os.getpid(), interval_s=2.0)
            if loss == "jsd"
            else contextlib.nullcontext() as sockets
        ):
            result = _run(flags, tmp_path / loss, "--algo.loss", loss, *more)  # (Ray's workers are ours)
        if sockets is not None:  # one of the runs watched: TCP and UDP
            assert sockets.seen and not [str(s) for s in sockets.seen if not s.loopback]
        a = rows(result.run_dir)
        assert a[-1]["eval/divergence"] < 0.8 * a[0]["eval/divergence"], (loss, a)
        assert a[-1]["train/loss"] < a[0]["train/loss"]
        assert a[0]["time/teacher"] > 0
        assert (result.run_dir / "loss_curve.png").stat().st_size and result.final_model.is_dir()


def test_top_k_of_the_vocabulary_precomputed_once_equals_the_full_teacher_each_step(
    ray_cluster, flags, tmp_path, demo_model_dir
):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(demo_model_dir).vocab_size
    full = rows(_run(flags, tmp_path / "full").run_dir)
    top = rows(_run(flags, tmp_path / "top", "--algo.top_k", str(vocab), "--teacher.precompute").run_dir)
    for x, y in zip(full, top, strict=True):
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-4)


@pytest.mark.slow
def test_a_run_killed_at_its_teacher_resumes_to_the_uninterrupted_run(ray_cluster, flags, tmp_path):
    """The teacher's rank SIGKILLed while it scores a step's examples: the driver starts both groups again
    and resumes from the latest checkpoint itself (--train.max_restarts), and ends as the uninterrupted
    run, bit for bit."""
    steps = [*flags, "--train.num_steps", "6", "--eval.every", "3", "--ckpt.save_steps", "1"]
    whole = _run(steps, tmp_path / "whole")
    address = ray_cluster.get_runtime_context().gcs_address
    run_dir = tmp_path / "killed"
    d = Driver("distill", steps, address, run_dir)
    d.wait_steps(kill_steps_rng().randint(2, 4))
    scoring = []  # the teacher's rank, caught while it scores a step's examples

    def caught() -> bool:
        scoring.extend(ray_workers("LearnerWorker.teacher_targets", d.started_since_boot))
        return bool(scoring)

    d.wait_for(caught, "a teacher call", poll=0.0005)
    scoring[0].kill()
    rc, _, err = d.finish()
    assert rc == 0, err[-3000:]
    assert "the teacher group's rank 0 died (" in err and "; restart 1 of 3, resuming from" in err, err[
        -3000:
    ]
    assert training_metrics(run_dir) == training_metrics(whole.run_dir)
    same_weights(run_dir / "final_model", whole.final_model)


def _error(*args: str) -> str:
    result = CliRunner().invoke(app, ["distill", "--dry-run", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


def test_bad_input_is_refused_in_one_line_before_start_up(demo_model_dir, teacher_dir, tmp_path):
    student = ["--model.pretrain", str(demo_model_dir)]
    assert (
        _error(*student)
        == "error: --teacher.pretrain: give the teacher model folder (rlhf distill needs one)"
    )
    both = [*student, "--teacher.pretrain", str(teacher_dir)]
    assert _error(*both, "--algo.top_k", "100000").startswith(
        "error: --algo.top_k 100000: more than the model's vocabulary of 512 tokens"
    )
    assert "beta: used by --algo.loss jsd only" in _error(*both, "--algo.beta", "0.3")
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(seed=5))  # another tokenizer
    line = _error(*student, "--teacher.pretrain", str(other))
    assert line.startswith(f"error: --teacher.pretrain {other}: its tokenizer is not the policy's")
    assert str(demo_model_dir) in line  # both folders are named
    plan = CliRunner().invoke(app, ["distill", "--dry-run", *both, "--ray.num_cpus", "2"])
    assert plan.exit_code == 0, plan.output
    assert any(line.startswith("teacher ") and "frozen" in line for line in plan.output.splitlines())
