"""Asynchronous against synchronous `rlhf ppo` on the same GRPO work (`_grpo_work.py`), in one run.

Runs, each in its own process, one after the other: synchronous with engines and learner unpinned (every
stage on every core), synchronous pinned (engines on the first half of the cores, learner on the rest),
asynchronous with max staleness 1 (pinned), and the same with partial rollout (`--modes` picks; "async
eta=1 unpinned" is there on request). For each: the median
s/step (steps after the first), the time split, how idle each core was over the training steps, and the
reward over samples trained (a PNG of the curves).

Run:
    uv run python benchmarks/ppo_async_cpu.py [--model small] [--steps 10] [--png ppo_async.png]

Target: asynchronous at least 1.3x the better synchronous baseline, with a reward curve no worse over
the same samples.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _grpo_work as work
import _summary

MODES = {
    "sync unpinned": ["--train.pin_cores", "false"],
    "sync pinned": ["--train.pin_cores", "true"],
    "async eta=1": ["--train.async.max_staleness", "1"],
    "async eta=1 partial": ["--train.async.max_staleness", "1", "--train.async.partial_rollout"],
    "async eta=1 unpinned": ["--train.async.max_staleness", "1", "--train.pin_cores", "false"],  # on request
}
TARGET = 1.3
SPLIT = ("time/generation", "time/learner", "time/sync", "time/wait_rollout")


class CoreIdle:
    """Samples each core's idle seconds while the run's metrics file grows: the window is from the first
    step's line to the last step's (start-up and export left out)."""

    def __init__(self, metrics: Path, steps: int) -> None:
        self.metrics, self.steps, self.marks = metrics, steps, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        while not self._stop.is_set():
            lines = len(self.metrics.read_text().splitlines()) if self.metrics.is_file() else 0
            for mark in (1, self.steps):
                if lines >= mark and mark not in self.marks:
                    self.marks[mark] = (time.perf_counter(), [c.idle for c in psutil.cpu_times(percpu=True)])
            time.sleep(0.05)

    def idle_fractions(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        if 1 not in self.marks or self.steps not in self.marks:
            return []
        (t0, a), (t1, b) = self.marks[1], self.marks[self.steps]
        return [round((y - x) / max(t1 - t0, 1e-9), 3) for x, y in zip(a, b, strict=True)]


def run_mode(model: str, mode: str, root: Path, steps: int, extra: list[str]) -> dict:
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.recipe import run

    folder = work.build_model(model, root)
    prompts, reward = work.write_inputs(root / "inputs")
    run_dir = root / "run"
    flags = work.ppo_flags(folder, prompts, reward, run_dir, steps) + MODES[mode] + extra
    idle = CoreIdle(run_dir / "metrics.jsonl", steps)
    history = run(build_config(PPOConfig, flags)).history
    return {
        "step_s": [r["time/step"] for r in history],
        "split": {k: statistics.median(r.get(k, 0.0) for r in history[1:]) for k in SPLIT},
        "staleness": [r.get("sync/staleness_mean", 0.0) for r in history],
        "reward": [r["rollout/reward_mean"] for r in history],
        "core_idle": idle.idle_fractions(),
    }


def in_subprocess(model: str, mode: str, steps: int, extra: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", mode, "--model", model, "--steps", str(steps)]
        cmd += ["--out", str(out), "--root", tmp, f"--flags={extra}"]
        subprocess.run(cmd, check=True, timeout=3600)
        return json.loads(out.read_text())


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_step = work.PROMPTS_PER_STEP * work.SAMPLES_PER_PROMPT
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, r in results.items():
        x = [per_step * (i + 1) for i in range(len(r["reward"]))]
        ax.plot(x, r["reward"], marker="o", label=mode)
    ax.set(title="reward over samples trained", xlabel="samples", ylabel="mean reward (digit fraction)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def report(results: dict, summary: str | None) -> None:
    print("\n| mode | s/step (median) | steps/s | " + " | ".join(SPLIT) + " | idle per core | reward curve |")
    print("|---|---|---|" + "---|" * len(SPLIT) + "---|---|")
    med = {m: statistics.median(r["step_s"][1:]) for m, r in results.items()}
    for mode, r in results.items():
        split = " | ".join(f"{r['split'][k]:.2f}" for k in SPLIT)
        curve = " ".join(f"{x:.2f}" for x in r["reward"])
        idle = " ".join(f"{x:.0%}" for x in r["core_idle"])
        print(f"| {mode} | {med[mode]:.2f} | {1 / med[mode]:.2f} | {split} | {idle} | {curve} |")
    syncs = [m for m in med if m.startswith("sync")]
    if not syncs:
        return
    best = min(syncs, key=med.get)
    for mode in (m for m in med if m.startswith("async")):
        ratio = med[best] / med[mode]
        print(f"{mode}: {ratio:.2f}x the better synchronous baseline ({best}, {med[best]:.2f} s/step)")
        detail = f"{med[mode]:.2f} vs {med[best]:.2f} s/step"
        _summary.ratio_row(summary, f"ppo {mode} / better sync", ratio, TARGET, detail)
        a, b = results[mode]["reward"], results[best]["reward"]
        print(
            f"  reward, mean over the run: {mode} {statistics.mean(a):.4f}, {best} {statistics.mean(b):.4f}"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small", choices=sorted(work.MODELS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--flags",
        default="auto",
        help="extra rlhf ppo flags for every mode; auto: --learner.precision bf16 where this CPU's bf16 is fast",
    )
    p.add_argument("--modes", default=",".join(list(MODES)[:4]))
    p.add_argument("--png", default="ppo_async.png")
    p.add_argument("--worker", choices=tuple(MODES))
    p.add_argument("--out")
    p.add_argument("--root")
    _summary.add_argument(p)
    a = p.parse_args()
    if a.flags == "auto":
        a.flags = f"--learner.precision {work.cpu_precision()}"
    if a.worker:
        result = run_mode(a.model, a.worker, Path(a.root), a.steps, a.flags.split())
        Path(a.out).write_text(json.dumps(result))
        return
    results = {m: in_subprocess(a.model, m, a.steps, a.flags) for m in a.modes.split(",")}
    report(results, a.summary)
    plot(results, Path(a.png))
    print(f"\nreward curves: {a.png} ({a.model} model, flags: {a.flags})")


if __name__ == "__main__":
    main()
