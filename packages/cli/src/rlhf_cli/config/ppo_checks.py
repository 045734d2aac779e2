"""Checks of ``rlhf ppo``'s configuration that span its namespaces (``PPOConfig``'s validators call them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_cli.config.ppo import PPOConfig

__all__ = ["check_distillation", "check_parallelism"]


def check_parallelism(cfg: PPOConfig) -> None:
    """Parallelism options the groups and engines can run."""
    split = cfg.learner.sequence_parallel_size > 1 or cfg.learner.tensor_parallel_size > 1
    if split and (cfg.uses_critic or cfg.reward.source == "model"):
        raise ValueError(
            "--learner.sequence_parallel_size / --learner.tensor_parallel_size apply to the actor and "
            "reference; the critic and the reward model run neither: use an estimator without a critic and a "
            "reward function or endpoint"
        )
    if cfg.actor.lora is not None and cfg.learner.tensor_parallel_size > 1:
        raise ValueError(
            "--actor.lora with --learner.tensor_parallel_size > 1: DeepSpeed's AutoTP does not train LoRA "
            "models"
        )
    if cfg.actor.lora is not None and cfg.learner.zero_stage == 3:
        raise ValueError("--actor.lora with --learner.zero_stage 3: LoRA runs with ZeRO stages 0-2 here")
    for name, group in (("actor", cfg.actor), ("critic", cfg.critic)):
        if group.model.compile and cfg.learner.zero_stage == 3:
            raise ValueError(
                f"--{name}.model.compile with --learner.zero_stage 3: torch.compile runs with ZeRO "
                "stages 0-2 here"
            )
    if cfg.rollout.tensor_parallel_size > 1 and not cfg.rollout.capabilities.tensor_parallel:
        raise ValueError(
            f"--rollout.tensor_parallel_size > 1: --rollout.backend {cfg.rollout.backend} does not shard a "
            "model"
        )


def check_distillation(cfg: PPOConfig) -> None:
    """The teacher's flags: dense distillation needs a teacher; its loss and beta need it, the
    sampled-token advantage's discount does not go with it. (Values are compared with the defaults, not
    asked whether they were given: a saved configuration holds every value.)"""
    d, defaults = cfg.algo.distill, type(cfg.algo.distill).model_fields
    if d.top_k is not None and not cfg.distills:
        raise ValueError("--algo.distill.top_k: dense distillation needs a teacher (--teacher.pretrain)")
    if d.top_k is None and (d.loss != defaults["loss"].default or d.beta != defaults["beta"].default):
        raise ValueError(
            "--algo.distill.loss, beta: used with --algo.distill.top_k only (dense distillation)"
        )
    if d.beta != defaults["beta"].default and d.loss != "jsd":
        raise ValueError(f"--algo.distill.beta: used by --algo.distill.loss jsd only, not {d.loss}")
    if d.top_k is not None and d.discount:
        raise ValueError(
            "--algo.distill.discount: a term of the sampled-token advantage, which dense distillation "
            f"(--algo.distill.top_k {d.top_k}; the distillation demo sets 16) replaces; "
            "--algo.distill.top_k null gives the advantage"
        )
