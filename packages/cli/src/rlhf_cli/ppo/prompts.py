"""The prompts ``rlhf ppo`` trains and evaluates on: ``--data.path`` / ``--eval.path``, or the built-in task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_cli.config import PPOConfig
from rlhf_cli.config.run import data_parallel_size
from rlhf_cli.data.images import check_sharded_mix, image_encoder
from rlhf_cli.data.prompts import PromptSet, load_records, with_template
from rlhf_cli.demo import task

__all__ = ["load_prompts", "skipped_notes"]


def load_prompts(cfg: PPOConfig, tokenizer: Any, model_dir: Path) -> tuple[PromptSet, PromptSet | None]:
    """Training prompts and evaluation prompts (None when there are none to evaluate on). Prompts that do
    not fit ``--rollout.max_model_len`` are skipped, counted and said (``--data.strict``: refused). With a
    vision-language model, rows may hold images (``--data.image_key``)."""
    limit = cfg.rollout.max_model_len
    encoder = image_encoder(model_dir)
    train, evals, source = _records(cfg, takes_images=encoder is not None)
    if any(r.images for r in [*train, *(evals or [])]):
        _check_image_run(cfg, source, model_dir)
        worlds = [cfg.actor.world_size]  # every group that forwards the images, each over its ranks
        worlds += [cfg.critic.world_size] if cfg.uses_critic else []
        worlds += [cfg.ref.world_size] if cfg.uses_reference else []
        ranks = max(data_parallel_size(w, cfg.learner) for w in worlds)
        mix = dict(learner=cfg.learner, ranks=ranks)
        check_sharded_mix(sum(bool(r.images) for r in train), len(train), **mix, what=source)
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
        encoder=encoder,
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
            encoder=encoder,
        )
    for line in skipped_notes(cfg, train_set, eval_set):
        print(line)
    return train_set, eval_set


def _records(cfg: PPOConfig, *, takes_images: bool) -> tuple[list, list | None, str]:
    """``(training records, evaluation records or None, the training source's name)``."""
    keys = dict(input_key=cfg.data.input_key, label_key=cfg.data.label_key, image_key=cfg.data.image_key)
    keys |= dict(model_takes_images=takes_images)
    if cfg.data.path is None:
        demo = task.builtin_task(cfg.train.demo_model)
        train = demo.records(seed=cfg.train.seed)
        evals = demo.records(seed=cfg.train.seed + 1) if cfg.eval.path is None else None
        source = f"built-in task {demo.TASK_NAME}"
    else:
        train = load_records(cfg.data.path, max_samples=cfg.data.max_samples, **keys)
        evals, source = None, str(cfg.data.path)
    if cfg.eval.path is not None:
        evals = load_records(cfg.eval.path, max_samples=cfg.eval.max_samples, flag="--eval.path", **keys)
    return train, evals, source


def _same_images(critic_dir: str, actor_dir: Path) -> bool:
    """The critic's model reads images as the actor's does: a vision-language model of its type, with its
    image token (the actor's processor makes the pixels both read)."""
    from rlhf_learner.models import check_model_dir, is_vision_language

    critic = check_model_dir(critic_dir, need_causal_lm=False, need_tokenizer=False)
    actor = check_model_dir(actor_dir, need_causal_lm=False, need_tokenizer=False)
    keys = ("model_type", "image_token_id")
    return is_vision_language(critic) and all(critic.get(k) == actor.get(k) for k in keys)


def _check_image_run(cfg: PPOConfig, source: str, model_dir: Path) -> None:
    """Refuse the groups that read text only, for prompts with images."""
    if cfg.uses_critic and cfg.critic.pretrain and not _same_images(cfg.critic.pretrain, model_dir):
        raise ValueError(
            f"{source}: prompts with images, but the critic (--critic.pretrain {cfg.critic.pretrain}) does "
            "not read them as the actor's model does (text-only, or another model type or image token); "
            "leave --critic.pretrain unset (the actor's model) or give a model of the actor's family"
        )
    if cfg.learner.sequence_parallel_size > 1:
        raise ValueError(
            f"{source}: prompts with images, but --learner.sequence_parallel_size "
            f"{cfg.learner.sequence_parallel_size} splits rows, which image rows are not"
        )
    if cfg.reward.pretrain is not None:
        raise ValueError(
            f"{source}: prompts with images, but the reward model (--reward.pretrain) reads text only; "
            "use --reward.func (it gets the images) or --reward.remote_url"
        )


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
