"""``rlhf ppo`` as a user runs it, in a subprocess: README's first command (the built-in demo). (Runs
against a cluster started with ``ray start`` are in ``test_kill_resume.py``.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rlhf_testkit import SocketWatcher

BIN = Path(sys.executable).parent
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_readme_first_command_learns_the_builtin_task(tmp_path):
    """`rlhf ppo` with no flags, in an environment without the suite's Ray variables: under 10 minutes,
    eval pass rate up by at least 20 points, and every socket its process tree listens on is loopback."""
    plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(BIN / "rlhf"), "ppo"],
        cwd=tmp_path,
        env=plain,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        with SocketWatcher(proc.pid) as sockets:
            stdout, stderr = proc.communicate(timeout=900)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, stderr[-3000:]
    names = {s.name for s in sockets.seen}
    assert {"gcs_server", "raylet"} <= names, names  # the watcher saw Ray's servers
    assert all(s.loopback for s in sockets.seen), sorted(str(s) for s in sockets.seen if not s.loopback)
    run_dir = tmp_path / "runs" / "ppo"
    rows = metrics(run_dir)
    passes = [r["eval/pass_rate"] for r in rows if "eval/pass_rate" in r]
    print(f"demo: {wall:.0f} s, eval pass rate {passes}")
    assert wall < 600
    assert len(passes) >= 3 and passes[-1] - passes[0] >= 0.20, passes
    assert all("eval/reward_mean" in r for r in rows if "eval/pass_rate" in r)
    for name in ("reward_curve.png", "summary.txt", "config.yaml"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "final_model" / "model.safetensors").is_file()
    assert "eval/pass_rate" in stdout  # the summary table
    # off a terminal: a plain line per step; none of the libraries' start-up noise
    steps = [line for line in stdout.splitlines() if line.startswith("ppo step ")]
    assert len(steps) == len(rows) and steps[-1].startswith(f"ppo step {len(rows)}/{len(rows)} "), steps[-2:]
    for noise in ("Setting accelerator to CPU", "Token authentication is enabled", "Writing model shards"):
        assert noise not in stderr, noise
    # the same command again would replace the finished run: refused in one line, nothing touched
    again = subprocess.run(
        [str(BIN / "rlhf"), "ppo"], cwd=tmp_path, env=plain, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: --logger.run_dir {run_dir} holds a previous run (metrics.jsonl, final_model): resume it with "
        "--ckpt.load_enable, replace it with --logger.overwrite, or pick another folder"
    ], again.stderr
    assert len(metrics(run_dir)) == len(rows)


@pytest.mark.slow
def test_the_distillation_demo_trains_its_teacher_then_distills_it(tmp_path, capsys):
    """`rlhf ppo --algo.advantage.estimator distill` with no model given: the large demo model learns the
    task first (warm-up and GRPO) in run_dir/teacher, then teaches the small one; a resumed run finds that
    teacher instead of training another."""
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.recipe import demo_teacher

    run_dir = tmp_path / "run"
    flags = ["--algo.advantage.estimator", "distill", "--logger.run_dir", str(run_dir)]
    flags += ["--train.num_steps", "1", "--train.warmup_sft_steps", "2", "--eval.every", "0"]
    flags += ["--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--ckpt.save_steps", "1"]
    out = subprocess.run(
        [str(BIN / "rlhf"), "ppo", *flags], env=ENV, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    teacher = run_dir / "teacher" / "final_model"
    assert "distillation demo: training the teacher" in out.stderr
    config = json.loads((teacher / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (3, 192)
    student = json.loads((run_dir / "final_model" / "config.json").read_text())
    assert (student["num_hidden_layers"], student["hidden_size"]) == (2, 128)
    assert all("distill/reverse_kl" not in r for r in metrics(run_dir / "teacher"))  # GRPO on the reward
    rows = metrics(run_dir)
    assert len(rows) == 1 and rows[0]["distill/reverse_kl"] > 0 and rows[0]["time/teacher"] > 0
    assert "actor/distill" in rows[0]  # the demo's default: dense, over the teacher's top 16
    assert f"pretrain: {teacher.absolute()}" in (run_dir / "config.yaml").read_text()
    taught = build_config(PPOConfig, [], config_file=run_dir / "teacher" / "config.yaml")  # loads back
    assert taught.algo.distill.top_k is None and not taught.distills
    # resumed at its last checkpoint: the same teacher, found, not trained again
    assert demo_teacher(build_config(PPOConfig, [*flags, "--ckpt.load_enable"])) == teacher
    assert f"distillation demo: the teacher in {teacher}" in capsys.readouterr().err


@pytest.mark.gpu
def test_ppo_on_a_gpu_uses_gpu_bundles_and_cuda_ipc(tmp_path):
    """On a CUDA machine (one GPU is enough): GPU bundles shared by the actor and the engine, weights over
    CUDA IPC, two steps."""
    args = [str(BIN / "rlhf"), "ppo", "--train.num_steps", "2", "--train.warmup_sft_steps", "2", "--ray.gpus_per_worker", "0.5",
            "--eval.every", "0", "--logger.progress", "false", "--logger.run_dir", str(tmp_path / "run")]  # fmt: skip
    plan = subprocess.run([*args, "--dry-run"], env=ENV, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0 and "GPU: 0.5" in plan.stdout and "over cuda_ipc" in plan.stdout, plan.stdout
    proc = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["sync/logp_mismatch_max"] < 1e-2


@pytest.mark.gpu
def test_the_image_demo_on_a_gpu_trains_its_vision_tower_and_sends_it_over_cuda_ipc(tmp_path):
    """The image demo on one GPU: vLLM's GPU runner given the images, the actor and the engine sharing GPU
    bundles, the vision tower trained and sent over CUDA IPC. In fp32 the engine samples the learner's
    log-probs after each sync (a tower left unsent is off by about 0.1)."""
    args = [str(BIN / "rlhf"), "ppo", "--train.demo_model", "vlm", "--actor.freeze_vision_tower", "false",
            "--learner.precision", "fp32", "--train.num_steps", "2", "--train.warmup_sft_steps", "2",
            "--ray.gpus_per_worker", "0.5", "--eval.every", "0", "--logger.progress", "false",
            "--logger.run_dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["sync/logp_mismatch_max"] < 1e-2
