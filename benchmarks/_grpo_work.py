"""The GRPO work `e2e_grpo_vs_trl.py` and `profile_ppo_step.py` share: the same offline models, prompts,
reward and settings for every framework.

Models: Qwen2 with a 320-token byte-level vocabulary, ~0.4M parameters (``tiny``) and ~23M (``small``:
8 layers x hidden 512 x MLP 1408). Prompts: 64 of the form ``add A B =``. Reward: the fraction of
digits in the completion. Sampling: 8 prompts x 4 samples, up to 64 new tokens, temperature 1.
Optimisation: lr 1e-5, KL 0.04 to a reference as a k3 loss, one optimizer step per batch.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

MODELS = {
    "tiny": dict(vocab_size=320),
    "small": dict(
        vocab_size=320,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
}
PROMPTS, PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, MAX_NEW_TOKENS = 64, 8, 4, 64
LR, KL_COEF = 1e-5, 0.04

REWARD_SOURCE = """def digit_fraction(text):
    return sum(c.isdigit() for c in text) / max(1, len(text))


def reward_func(queries, prompts, labels, **_):
    return [digit_fraction(q[len(p):]) for q, p in zip(queries, prompts)]
"""
"""The reward as a file `rlhf ppo --reward.func` loads (queries are prompt + completion)."""


def digit_fraction(text: str) -> float:
    """The same reward, for TRL's reward function (it sees the completions alone)."""
    return sum(c.isdigit() for c in text) / max(1, len(text))


def cpu_precision() -> str:
    """``bf16`` where this CPU multiplies bf16 matrices faster than fp32 ones (CPUs with AMX: 3-7x faster
    at 2048²), else ``fp32`` (AVX2-only CPUs: about 100x slower in bf16). Measured, about 0.1 s."""
    from rlhf_learner.hardware import cpu_matmul_speed

    return "bf16" if cpu_matmul_speed().bf16_slowdown < 1 else "fp32"


def build_model(name: str, root: Path) -> Path:
    """The model ``name`` (built offline, once per folder)."""
    from rlhf_cli.demo.tiny_model import TinyModelSpec, build_tiny_model

    folder = root / f"model_{name}"
    if (folder / "config.json").is_file():
        return folder
    return build_tiny_model(folder, TinyModelSpec(**MODELS[name]))


def prompt_texts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"add {rng.randrange(100)} {rng.randrange(100)} =" for _ in range(PROMPTS)]


def write_inputs(root: Path) -> tuple[Path, Path]:
    """The prompts as JSONL and the reward file, for `rlhf ppo`."""
    root.mkdir(parents=True, exist_ok=True)
    prompts, reward = root / "prompts.jsonl", root / "reward.py"
    prompts.write_text("".join(json.dumps({"input": p, "label": 0}) + "\n" for p in prompt_texts()))
    reward.write_text(REWARD_SOURCE)
    return prompts, reward


def ppo_flags(model: Path, prompts: Path, reward: Path, run_dir: Path, steps: int) -> list[str]:
    """`rlhf ppo` on the work (GRPO: group_norm advantages, KL as a k3 loss, no critic)."""
    return [
        *("--actor.pretrain", str(model), "--data.path", str(prompts), "--reward.func", str(reward)),
        *("--algo.advantage.estimator", "group_norm"),
        *(
            "--rollout.batch_size",
            str(PROMPTS_PER_STEP),
            "--rollout.n_samples_per_prompt",
            str(SAMPLES_PER_PROMPT),
        ),
        *("--rollout.max_new_tokens", str(MAX_NEW_TOKENS), "--rollout.temperature", "1.0"),
        *(
            "--actor.lr",
            str(LR),
            "--algo.kl.coef",
            str(KL_COEF),
            "--algo.kl.use_loss",
            "--algo.kl.estimator",
            "k3",
        ),
        *("--train.num_steps", str(steps), "--train.micro_batch_size", "32", "--eval.every", "0"),
        *("--logger.progress", "false", "--logger.tensorboard", "false", "--logger.run_dir", str(run_dir)),
        *("--logger.overwrite", "--rollout.max_model_len", "512"),
    ]
