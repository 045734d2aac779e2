"""Where a PPO step's time goes on CPU: the per-step split of `rlhf ppo` on the tiny and the ~25M model.

Run: uv run python benchmarks/ppo_cpu.py [--models tiny,small] [--steps 6]

Each model trains on the built-in task (its prompts and reward) with a reference group (KL in the reward)
and one vLLM-CPU engine: 16 prompts x 8 samples, <= 32 new tokens, packed micro-batches of 32, ZeRO-2.
The first step is dropped (warm caches); the table gives medians of the others, in seconds, and each
stage's share of the step. Ratios, not absolute times, are what carry over between machines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

from rollout_cpu import MODELS

STAGES = ("generation", "reward", "reference", "learner", "sync")


def bench(name: str, root: Path, steps: int) -> dict[str, float]:
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.recipe import run
    from rlhf_testkit import TinyModelSpec, build_tiny_model

    model = build_tiny_model(root / name, TinyModelSpec(**MODELS[name]))
    cfg = build_config(
        PPOConfig,
        [
            "--actor.pretrain",
            str(model),
            "--train.num_steps",
            str(steps),
            "--train.warmup_sft_steps",
            "0",
            "--rollout.batch_size",
            "16",
            "--rollout.n_samples_per_prompt",
            "8",
            "--rollout.max_new_tokens",
            "32",
            "--rollout.temperature",
            "1.0",
            "--train.micro_batch_size",
            "32",
            "--algo.kl.coef",
            "0.01",
            "--eval.every",
            "0",
            "--logger.progress",
            "false",
            "--logger.tensorboard",
            "false",
            "--logger.run_dir",
            str(root / f"run_{name}"),
        ],
    )
    rows = run(cfg).history[1:]
    out = {k: statistics.median(r[f"time/{k}"] for r in rows) for k in (*STAGES, "step")}
    out["params_m"] = (
        sum(
            p.numel()
            for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(model).parameters()
        )
        / 1e6
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            results[name] = bench(name, Path(tmp), args.steps)
    print("\n| model | step (s) | " + " | ".join(STAGES) + " |")
    print("|---|---|" + "---|" * len(STAGES))
    for name, r in results.items():
        cells = " | ".join(f"{r[k]:.2f} s ({100 * r[k] / r['step']:.0f}%)" for k in STAGES)
        print(f"| {name} ({r['params_m']:.1f}M) | {r['step']:.2f} | {cells} |")


if __name__ == "__main__":
    main()
