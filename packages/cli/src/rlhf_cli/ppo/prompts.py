"""The prompts ``rlhf ppo`` trains and evaluates on: ``--data.path`` / ``--eval.path``, or the built-in task."""

from __future__ import annotations

from typing import Any

from rlhf_cli.config import PPOConfig
from rlhf_cli.data.prompts import PromptSet, load_records, with_template
from rlhf_cli.demo import task

__all__ = ["load_prompts", "skipped_notes"]


def load_prompts(cfg: PPOConfig, tokenizer: Any) -> tuple[PromptSet, PromptSet | None]:
    """Training prompts and evaluation prompts (None when there are none to evaluate on). Prompts that do
    not fit ``--rollout.max_model_len`` are skipped, counted and said (``--data.strict``: refused)."""
    limit = cfg.rollout.max_model_len
    if cfg.data.path is None:
        train = task.records(seed=cfg.train.seed)
        evals = task.records(seed=cfg.train.seed + 1) if cfg.eval.path is None else None
        source = f"built-in task {task.TASK_NAME}"
    else:
        train = load_records(
            cfg.data.path,
            input_key=cfg.data.input_key,
            label_key=cfg.data.label_key,
            max_samples=cfg.data.max_samples,
        )
        evals, source = None, str(cfg.data.path)
    if cfg.eval.path is not None:
        evals = load_records(
            cfg.eval.path,
            input_key=cfg.data.input_key,
            label_key=cfg.data.label_key,
            max_samples=cfg.eval.max_samples,
            flag="--eval.path",
        )
    template = cfg.data.input_template
    train = with_template(train, template, source=source)
    evals = with_template(evals, template, source="evaluation prompts") if evals else evals
    chat = cfg.data.apply_chat_template
    strict = cfg.data.strict
    train_set = PromptSet.from_records(
        train,
        tokenizer,
        apply_chat_template=chat,
        seed=cfg.train.seed,
        max_prompt_len=limit,
        source=source,
        strict=strict,
    )
    eval_set = None
    if evals:
        evals = evals[: cfg.eval.max_samples] if cfg.eval.max_samples else evals
        eval_set = PromptSet.from_records(
            evals,
            tokenizer,
            apply_chat_template=chat,
            seed=cfg.train.seed,
            max_prompt_len=limit,
            source="evaluation prompts",
            strict=strict,
        )
    for line in skipped_notes(cfg, train_set, eval_set):
        print(line)
    return train_set, eval_set


def skipped_notes(cfg: PPOConfig, train: PromptSet, evals: PromptSet | None) -> list[str]:
    """A line per prompt set that left prompts out for not fitting the context."""
    limit = cfg.rollout.max_model_len
    lines = []
    for name, ps in (("training", train), ("evaluation", evals)):
        if ps is not None and ps.skipped:
            first = ", ".join(map(str, ps.skipped[:5])) + (", ..." if len(ps.skipped) > 5 else "")
            lines.append(
                f"skipped {len(ps.skipped)} {name} prompt(s) of {limit}+ tokens (--rollout.max_model_len "
                f"{limit}; --data.strict refuses them): positions {first}"
            )
    return lines
