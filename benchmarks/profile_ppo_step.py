"""Where one `rlhf ppo` step's time goes on this machine, stage by stage, and how busy each core was.

Run: uv run python benchmarks/profile_ppo_step.py [--models tiny,small] [--steps 8] [--write-readme]
     [-- extra rlhf ppo flags, e.g. --learner.precision bf16]

The work is `e2e_grpo_vs_trl.py`'s (`_grpo_work.py`): GRPO with a k3 KL loss, 8 prompts x 4 samples,
<= 64 new tokens. `rlhf ppo` runs as a user runs it (its own process); this script reads the stage times
each step logs (`time/*` in metrics.jsonl) and samples every core's busy time between steps (psutil).
Medians of steps 2..N. `overhead` is the step's time outside the stages (Ray calls, data, logging);
`idle` is the core-seconds no process used, per step; `to step 1` is the start-up and the first step: the
seconds from the command to step 1's record, and the core-seconds every process used meanwhile.
`--write-readme` puts the table in benchmarks/README.md (between the profile markers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _grpo_work as work
import _summary

STAGES = (
    "generation",
    "reward",
    "old_policy",
    "reference",
    "values",
    "advantages",
    "actor_update",
    "critic_update",
    "sync",
)
BEGIN, END = "<!-- profile_ppo_step:begin -->", "<!-- profile_ppo_step:end -->"


def _busy() -> list[float]:
    """Seconds each core has not been idle since boot."""
    import psutil

    return [t.user + t.nice + t.system + t.irq + t.softirq for t in psutil.cpu_times(percpu=True)]


def profile(model: str, root: Path, steps: int, extra: list[str]) -> dict:
    folder = work.build_model(model, root)
    prompts, reward = work.write_inputs(root / "inputs")
    run_dir = root / f"run_{model}"
    flags = work.ppo_flags(folder, prompts, reward, run_dir, steps) + extra
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    start = (time.perf_counter(), _busy())
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_cli.main", "ppo", *flags], env=env)
    marks: list[tuple[float, list[float]]] = []  # (time, per-core busy) as each step's record appears
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        n = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        if n > len(marks):
            marks.append((time.perf_counter(), _busy()))
        time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(f"rlhf ppo failed ({proc.returncode})")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
    per_core = [
        [(b1 - b0) / (t1 - t0) for b0, b1 in zip(c0, c1, strict=True)]
        for (t0, c0), (t1, c1) in itertools.pairwise(marks)
    ]
    out = {k: statistics.median(r.get(f"time/{k}", 0.0) for r in rows) for k in (*STAGES, "step")}
    out["overhead"] = statistics.median(
        r["time/step"] - sum(r.get(f"time/{k}", 0.0) for k in STAGES) for r in rows
    )
    cores = [statistics.median(c[i] for c in per_core) for i in range(len(per_core[0]))] if per_core else []
    out["busy"] = cores
    out["idle"] = out["step"] * sum(1 - min(1.0, b) for b in cores)
    # start-up and the first step: from the command to step 1's record, in seconds and in core-seconds
    out["first_step"] = marks[0][0] - start[0]
    out["first_step_busy"] = sum(marks[0][1]) - sum(start[1])
    return out


def table(results: dict) -> str:
    cols = (*STAGES, "overhead")
    lines = [
        "| model | step | " + " | ".join(cols) + " | idle core-s | busy per core | to step 1 |",
        "|---|---|" + "---|" * len(cols) + "---|---|---|",
    ]
    for model, r in results.items():
        cells = " | ".join(f"{r[k]:.2f} ({100 * r[k] / r['step']:.0f}%)" for k in cols)
        busy = " ".join(f"{100 * b:.0f}%" for b in r["busy"])
        first = f"{r['first_step']:.1f} s, {r['first_step_busy']:.0f} core-s"
        lines.append(f"| {model} | {r['step']:.2f} s | {cells} | {r['idle']:.2f} | {busy} | {first} |")
    return "\n".join(lines)


def write_readme(text: str, flags: list[str]) -> None:
    path = Path(__file__).resolve().parent / "README.md"
    doc = path.read_text()
    stamp = time.strftime("%Y-%m-%d")
    block = f"{BEGIN}\n`uv run python benchmarks/profile_ppo_step.py{' -- ' + ' '.join(flags) if flags else ''}` ({stamp}, {os.cpu_count()} cores; seconds, medians of steps 2..N):\n\n{text}\n{END}"
    if BEGIN in doc:
        doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END) :]
    else:
        doc += f"\n## profile_ppo_step.py\n\n{block}\n"
    path.write_text(doc)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--write-readme", action="store_true")
    _summary.add_argument(p)
    a = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = {m: profile(m, Path(tmp), a.steps, extra) for m in a.models.split(",")}
    text = table(results)
    print(text)
    for model, r in results.items():
        stages = ", ".join(f"{k} {r[k]:.2f}" for k in (*STAGES, "overhead") if r[k] >= 0.005)
        busy = " ".join(f"{100 * b:.0f}%" for b in r["busy"])
        _summary.row(
            a.summary,
            f"profile {model} model: s/step",
            f"{r['step']:.2f} s ({stages}; busy {busy}; to step 1 {r['first_step']:.1f} s)",
            "-",
            "-",
        )
    if a.write_readme:
        write_readme(text, extra)


if __name__ == "__main__":
    main()
