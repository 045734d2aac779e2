"""On-policy distillation against GRPO alone, and the two mixed, on the built-in task, in one run.

1. The teacher: the large demo model (3 layers of 192 against the small one's 2 of 128), trained with the
   demo's warm-up and GRPO for `--teacher-steps` steps (`rlhf ppo --train.demo_model large`).
2. Students, each the small demo model with the same warm-up and samples per step, for `--steps` steps,
   once per seed in `--seeds` (`--train.seed`, which also sets the warm-up):
   - `distill`: the teacher's sampled-token advantage alone (`--algo.advantage.estimator distill
     --teacher.pretrain T`, no reward);
   - `dense`: the same with the teacher's top k at every sampled token (`--algo.distill.top_k K`): the
     loss holds the student's reverse KL to that distribution;
   - `grpo`: `rlhf ppo`, the reward alone;
   - `mixed`: GRPO plus `--algo.distill.coef` times the dense term (`--top-k 0`: the sampled-token
     advantage).

Each run is `rlhf ppo`'s own recipe in a process of its own. Reported: the greedy eval pass rate of each
student at every evaluation, the teacher's last one, and per seed the first evaluated step at which each
student reaches 90% of the teacher's pass rate; the curves go to a PNG, one panel per seed.

Run:
    uv run python benchmarks/distill_cpu.py [--teacher-steps 150] [--steps 30] [--seeds 42,1,7]

Target: a distilled student reaches 90% of the teacher's pass rate in fewer steps than GRPO alone, on
every seed.
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


def student_flags(name: str, teacher: str, coef: float, top_k: int) -> list[str]:
    dense = ["--algo.distill.top_k", str(top_k)] if top_k else []
    return {
        "distill": ["--algo.advantage.estimator", "distill", "--teacher.pretrain", teacher],
        "dense": ["--algo.advantage.estimator", "distill", "--teacher.pretrain", teacher, *dense],
        "grpo": [],
        "mixed": ["--algo.distill.coef", str(coef), "--teacher.pretrain", teacher, *dense],
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


def plot(runs: dict, teacher_rate: float, path: Path) -> None:
    """One panel per seed: each student's pass rate per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = list(runs)
    fig, axes = plt.subplots(1, len(seeds), figsize=(5 * len(seeds), 4), squeeze=False, sharey=True)
    for ax, seed in zip(axes[0], seeds, strict=True):
        for name, r in runs[seed].items():
            ax.plot([s for s, _ in r["curve"]], [p for _, p in r["curve"]], marker=".", label=name)
        ax.axhline(teacher_rate, color="black", linestyle="--", label=f"teacher ({teacher_rate:.2f})")
        ax.axhline(SHARE * teacher_rate, color="grey", linestyle=":", label=f"{SHARE:.0%} of the teacher")
        ax.set(title=f"seed {seed}", xlabel="step (same samples per step)", ylabel="eval pass rate (greedy)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path)


def report(runs: dict, teacher_rate: float, summary: str | None) -> None:
    level = SHARE * teacher_rate
    print(f"\nteacher pass rate {teacher_rate:.3f}; {SHARE:.0%} of it: {level:.3f}\n")
    print("| seed | student | pass rate at each evaluation (step: rate) | first step at 90% of the teacher |")
    print("|---|---|---|---|")
    reached: dict[str, dict] = {}
    for seed, students in runs.items():
        for name, r in students.items():
            step = first_reaching(r["curve"], level)
            reached.setdefault(name, {})[seed] = step
            curve = " ".join(f"{s}:{p:.2f}" for s, p in r["curve"])
            print(f"| {seed} | {name} | {curve} | {step if step is not None else 'not reached'} |")
    print("\nfirst step at 90% of the teacher, per seed:\n")
    print("| student | " + " | ".join(f"seed {s}" for s in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for name, by_seed in reached.items():
        print(f"| {name} | " + " | ".join(str(by_seed[s] or "-") for s in runs) + " |")
    never = 10**9
    grpo = reached.get("grpo", {})
    for name in ("distill", "dense", "mixed"):
        if name not in reached or not grpo:
            continue
        mine = reached[name]
        fewer = all((mine[s] or never) < (grpo[s] or never) for s in runs)
        result = ", ".join(f"{mine[s] or '-'} vs {grpo[s] or '-'}" for s in runs)
        _summary.row(
            summary,
            f"{name}: steps to {SHARE:.0%} of the teacher, against GRPO, per seed",
            result,
            "fewer than GRPO on every seed",
            "yes" if fewer else "NO",
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--teacher-steps", type=int, default=150)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=2, help="evaluate every N steps (and before the first)")
    p.add_argument("--students", default="distill,dense,grpo,mixed")
    p.add_argument("--seeds", default="42,1,7", help="--train.seed of each student's runs")
    p.add_argument("--coef", type=float, default=1.0, help="--algo.distill.coef of the mixed student")
    p.add_argument("--top-k", type=int, default=16, help="--algo.distill.top_k of dense and mixed (0: unset)")
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
    if a.top_k == 0 and "dense" in a.students.split(","):
        p.error("--top-k 0: the dense student would be the distill one; drop it from --students")
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
        runs: dict = {}
        for seed in a.seeds.split(","):
            for name in a.students.split(","):
                print(f"student: {name}, seed {seed}, {a.steps} steps", file=sys.stderr)
                flags = student_flags(name, teacher["final_model"], a.coef, a.top_k) + extra
                flags += [*a.student_flags.split(), "--train.seed", seed]
                runs.setdefault(seed, {})[name] = in_subprocess(
                    root / f"{name}-{seed}", a.steps, a.every, flags
                )
        report(runs, teacher_rate, a.summary)
        plot(runs, teacher_rate, Path(a.png))
        print(f"\ncurves: {a.png}")


if __name__ == "__main__":
    main()
