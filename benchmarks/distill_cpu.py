"""On-policy distillation against GRPO alone, and the two mixed, on the built-in task, in one run.

1. The teacher: the large demo model (3 layers of 192 against the small one's 2 of 128), trained with the
   demo's warm-up and GRPO for `--teacher-steps` steps (`rlhf ppo --train.demo_model large`).
2. Three students, each the small demo model with the same warm-up, seed, and samples per step, for
   `--steps` steps: `distill` (`--algo.advantage.estimator distill --teacher.pretrain T`, no reward),
   `grpo` (`rlhf ppo`, the reward alone), and `mixed` (GRPO plus `--algo.distill.coef` times the
   teacher's per-token advantage).

Each run is `rlhf ppo`'s own recipe in a process of its own. Reported: the greedy eval pass rate of each
student at every evaluation, the teacher's last one, and the first evaluated step at which each student
reaches 90% of the teacher's pass rate; the curves go to a PNG.

Run:
    uv run python benchmarks/distill_cpu.py [--teacher-steps 150] [--steps 40] [--png distill.png]

Target: a distilled student (distill or mixed) reaches 90% of the teacher's pass rate in fewer steps than
GRPO alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _summary

SHARE = 0.9
"""The share of the teacher's pass rate a student must reach."""


def student_flags(name: str, teacher: str, coef: float) -> list[str]:
    return {
        "distill": ["--algo.advantage.estimator", "distill", "--teacher.pretrain", teacher],
        "grpo": [],
        "mixed": ["--algo.distill.coef", str(coef), "--teacher.pretrain", teacher],
    }[name]


def run_worker(run_dir: Path, steps: int, every: int, flags: list[str], out: Path) -> None:
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.recipe import run

    common = ["--logger.run_dir", str(run_dir), "--logger.progress", "false", "--logger.tensorboard", "false"]
    common += ["--train.num_steps", str(steps), "--eval.every", str(every)]
    result = run(build_config(PPOConfig, [*common, *flags]))
    curve = [(r["step"], r["eval/pass_rate"]) for r in result.history if "eval/pass_rate" in r]
    out.write_text(json.dumps({"curve": curve, "final_model": str(result.final_model)}))


def in_subprocess(run_dir: Path, steps: int, every: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", str(run_dir), "--steps", str(steps)]
        cmd += ["--every", str(every), "--out", str(out), f"--flags={json.dumps(flags)}"]
        subprocess.run(cmd, check=True, timeout=3600)
        return json.loads(out.read_text())


def reused_teacher(run_dir: Path) -> dict:
    """An earlier teacher run's result: its evaluations (metrics.jsonl) and its final model."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval/pass_rate"]) for r in rows if "eval/pass_rate" in r]
    return {"curve": curve, "final_model": str(run_dir / "final_model")}


def first_reaching(curve: list, level: float) -> int | None:
    """The first evaluated step whose pass rate is at least ``level`` (the evaluation before step 1
    excluded: it is the warm-up's, the same for every student)."""
    return next((step for step, rate in curve[1:] if rate >= level), None)


def plot(students: dict, teacher_rate: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in students.items():
        ax.plot([s for s, _ in r["curve"]], [p for _, p in r["curve"]], marker="o", label=name)
    ax.axhline(teacher_rate, color="black", linestyle="--", label=f"teacher ({teacher_rate:.2f})")
    ax.axhline(SHARE * teacher_rate, color="grey", linestyle=":", label=f"{SHARE:.0%} of the teacher")
    ax.set(title="student eval pass rate (greedy)", xlabel="step (same samples per step)", ylabel="pass rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def report(students: dict, teacher_rate: float, summary: str | None) -> None:
    level = SHARE * teacher_rate
    print(f"\nteacher pass rate {teacher_rate:.3f}; {SHARE:.0%} of it: {level:.3f}\n")
    print("| student | pass rate at each evaluation (step: rate) | first step at 90% of the teacher |")
    print("|---|---|---|")
    reached = {}
    for name, r in students.items():
        reached[name] = first_reaching(r["curve"], level)
        curve = " ".join(f"{s}:{p:.2f}" for s, p in r["curve"])
        print(f"| {name} | {curve} | {reached[name] if reached[name] is not None else 'not reached'} |")
    never = 10**9
    grpo = reached.get("grpo") or never
    for name in ("distill", "mixed"):
        if name not in reached:
            continue
        mine = reached[name] or never
        passed = "yes" if mine < grpo else "NO"
        result = f"{reached[name] or '-'} vs GRPO {reached.get('grpo') or '-'} steps"
        _summary.row(
            summary, f"{name}: steps to {SHARE:.0%} of the teacher", result, "fewer than GRPO", passed
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--teacher-steps", type=int, default=150)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="evaluate every N steps (and before the first)")
    p.add_argument("--students", default="distill,grpo,mixed")
    p.add_argument("--coef", type=float, default=1.0, help="--algo.distill.coef of the mixed student")
    p.add_argument("--png", default="distill.png")
    p.add_argument("--keep", default=None, help="folder to keep the runs in (default: a temporary one)")
    p.add_argument("--extra", default="--algo.stop_penalty 0", help="more rlhf ppo flags for every run")
    p.add_argument(
        "--teacher-flags", default="--actor.lr 1e-3", help="more rlhf ppo flags for the teacher's run"
    )
    p.add_argument("--student-flags", default="", help="more rlhf ppo flags for the students' runs")
    p.add_argument("--teacher-dir", default=None, help="a teacher run folder of an earlier run to reuse")
    p.add_argument("--worker")
    p.add_argument("--out")
    p.add_argument("--flags", default="[]")
    _summary.add_argument(p)
    a = p.parse_args()
    if a.worker:
        run_worker(Path(a.worker), a.steps, a.every, json.loads(a.flags), Path(a.out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.keep or tmp)
        extra = a.extra.split()
        if a.teacher_dir:
            teacher = reused_teacher(Path(a.teacher_dir))
        else:
            print(f"teacher: the large demo model, {a.teacher_steps} GRPO steps", file=sys.stderr)
            flags = ["--train.demo_model", "large", *extra, *a.teacher_flags.split()]
            teacher = in_subprocess(root / "teacher", a.teacher_steps, a.every, flags)
        teacher_rate = teacher["curve"][-1][1]
        students = {}
        for name in a.students.split(","):
            print(f"student: {name}, {a.steps} steps", file=sys.stderr)
            flags = student_flags(name, teacher["final_model"], a.coef) + extra + a.student_flags.split()
            students[name] = in_subprocess(root / name, a.steps, a.every, flags)
        report(students, teacher_rate, a.summary)
        plot(students, teacher_rate, Path(a.png))
        print(f"\ncurves: {a.png}")


if __name__ == "__main__":
    main()
