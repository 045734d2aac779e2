"""The warning for bf16 on a CPU whose bf16 matrix multiplies are slow (the speed is an input here: the
measurement itself is rlhf-learner's, tested there)."""

import functools

import pytest
from rlhf_cli.config import PPOConfig, build_config
from rlhf_cli.config.offline import SFTConfig
from rlhf_cli.main import app
from rlhf_cli.ppo import recipe
from rlhf_cli.runtime.host import precision
from rlhf_cli.runtime.host.precision import slow_bf16_note
from rlhf_cli.runtime.runs.run import prepare_run
from rlhf_learner.hardware import MatmulSpeed
from typer.testing import CliRunner

SLOW = MatmulSpeed(size=256, fp32_gflops=140.0, bf16_gflops=1.4)  # an AVX2-only CPU
FAST = MatmulSpeed(size=256, fp32_gflops=220.0, bf16_gflops=750.0)  # a CPU with AMX


def measured(speed: MatmulSpeed, calls: list):
    def measure() -> MatmulSpeed:
        calls.append(speed)
        return speed

    return measure


def test_bf16_learners_on_a_slow_cpu_are_warned_with_the_figures():
    cfg = build_config(PPOConfig, ["--learner.precision", "bf16"])
    note = slow_bf16_note(cfg, gpus=0, measure=measured(SLOW, []))
    assert note is not None and note.startswith("--learner.precision bf16: ")
    assert "100x slower than fp32 (1.4 against 140 GFLOP/s" in note
    sft = build_config(SFTConfig, ["--learner.precision", "bf16"])
    assert slow_bf16_note(sft, gpus=0, measure=measured(SLOW, [])).startswith("--learner.precision bf16: ")


def test_the_engines_own_bf16_is_named():
    cfg = build_config(PPOConfig, ["--rollout.dtype", "bfloat16"])
    assert slow_bf16_note(cfg, gpus=0, measure=measured(SLOW, [])).startswith("--rollout.dtype bfloat16: ")
    both = build_config(PPOConfig, ["--rollout.dtype", "bfloat16", "--learner.precision", "bf16"])
    note = slow_bf16_note(both, gpus=0, measure=measured(SLOW, []))
    assert note.startswith("--learner.precision bf16 and --rollout.dtype bfloat16: ")


@pytest.mark.parametrize(
    ("flags", "gpus", "speed", "measures"),
    [
        ([], 0, SLOW, 0),  # fp32: nothing to measure
        (["--learner.precision", "bf16"], 1, SLOW, 0),  # on GPUs
        (["--learner.precision", "bf16"], 0, FAST, 1),  # bf16 is the fast one here
    ],
)
def test_no_warning(flags, gpus, speed, measures):
    calls: list = []
    assert slow_bf16_note(build_config(PPOConfig, flags), gpus=gpus, measure=measured(speed, calls)) is None
    assert len(calls) == measures


def test_dry_run_shows_the_warning_in_the_plan(monkeypatch):
    monkeypatch.setattr(precision, "cpu_matmul_speed", measured(SLOW, []))
    result = CliRunner().invoke(
        app, ["ppo", "--dry-run", "--learner.precision", "bf16", "--ray.num_cpus", "2"]
    )
    assert result.exit_code == 0, result.output
    assert (
        "\n--learner.precision bf16: this CPU multiplies bf16 matrices 100x slower than fp32" in result.output
    )


@pytest.mark.parametrize(("flags", "warnings"), [(["--learner.precision", "bf16"], 1), ([], 0)])
def test_a_run_warns_once_before_it_starts(monkeypatch, capsys, tmp_path, flags, warnings):
    calls: list = []
    monkeypatch.setattr(precision, "cpu_matmul_speed", measured(SLOW, calls))
    cfg = build_config(PPOConfig, [*flags, "--logger.run_dir", str(tmp_path / "run"), "--ray.num_cpus", "2"])
    prepare_run(cfg, pretrain=None, plan_for=functools.partial(recipe._plan_for, cfg))
    err = capsys.readouterr().err
    assert err.count("warning: --learner.precision bf16: this CPU multiplies bf16 matrices 100x") == warnings
    assert len(calls) == warnings
