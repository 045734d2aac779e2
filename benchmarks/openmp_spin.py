"""`rlhf ppo` (the built-in task, a few steps) alone and beside a one-core busy loop, with libgomp's
default spin count and with ours (`rlhf_cli.runtime.host.openmp.SPIN_COUNT`), each run in its own process
tree from a plain environment, one after the other.

Run: uv run python benchmarks/openmp_spin.py [--steps 20]

Prints, per spin count, the median s/step of steps 2..N and the run's wall time alone and loaded, the
slowdown under load, and ours against libgomp's default (above 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _summary
from rlhf_cli.runtime.host.openmp import SPIN_COUNT

LIBGOMP_DEFAULT = 300_000
"""libgomp's spin count when neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY is set."""


def run(spin: int, loaded: bool, steps: int) -> tuple[float, float]:
    """One `rlhf ppo` run (median s/step of steps 2..N, wall s), beside a busy loop when ``loaded``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "OMP_", "GOMP_"))}
    env["GOMP_SPINCOUNT"] = str(spin)
    busy = None
    if loaded:  # its own session, as another user's job would be
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            flags = ["--train.num_steps", str(steps), "--eval.every", "0", "--logger.progress", "false"]
            t0 = time.monotonic()
            cmd = [str(Path(sys.executable).parent / "rlhf"), "ppo", *flags, "--logger.run_dir", f"{tmp}/run"]
            subprocess.run(cmd, env=env, cwd=tmp, check=True, capture_output=True, timeout=1800)
            wall = time.monotonic() - t0
            lines = Path(tmp, "run", "metrics.jsonl").read_text().splitlines()
            step = statistics.median(json.loads(line)["time/step"] for line in lines[1:])
    finally:
        if busy is not None:
            busy.kill()
            busy.wait(timeout=30)
    return step, wall


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    _summary.add_argument(p)
    a = p.parse_args()
    res = {(s, ld): run(s, ld, a.steps) for s in (LIBGOMP_DEFAULT, SPIN_COUNT) for ld in (False, True)}
    print("\n| GOMP_SPINCOUNT | s/step alone | s/step loaded | wall alone | wall loaded | slowdown loaded |")
    print("|---|---|---|---|---|---|")
    for s in (LIBGOMP_DEFAULT, SPIN_COUNT):
        (st, wt), (sl, wl) = res[s, False], res[s, True]
        print(f"| {s:,} | {st:.3f} | {sl:.3f} | {wt:.0f} s | {wl:.0f} s | {sl / st:.2f}x |")
    alone = res[LIBGOMP_DEFAULT, False][0] / res[SPIN_COUNT, False][0]
    loaded = res[LIBGOMP_DEFAULT, True][0] / res[SPIN_COUNT, True][0]
    print(f"\nours / libgomp's default, s/step: alone {alone:.2f}x, beside a busy core {loaded:.2f}x")
    _summary.ratio_row(a.summary, "OpenMP spin count alone: libgomp default s/step / ours", alone, None)
    _summary.ratio_row(a.summary, "OpenMP spin count beside a busy core: default / ours", loaded, 1.5)


if __name__ == "__main__":
    main()
