"""Model groups: the trained actor and critic, the frozen reference, and the reward sources."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from rlhf_learner import LoraOptions, ModelOptions
from rlhf_learner.strategy import LRSchedule

from rlhf_cli.config._base import Section

__all__ = [
    "REWARD_TOKEN_ENV",
    "ActorConfig",
    "CriticConfig",
    "GroupShape",
    "RefConfig",
    "RewardConfig",
    "TeacherConfig",
    "TrainedGroup",
]

REWARD_TOKEN_ENV = "RLHF_REWARD_TOKEN"
"""Bearer token: sent to --reward.remote_url servers when set, and checked by rlhf serve-rm."""


class GroupShape(Section):
    """How many Ray processes a learner group runs: nodes x devices per node data-parallel ranks."""

    num_nodes: int = Field(1, ge=1)
    """Nodes of the group (ranks = num_nodes x num_devices_per_node): above 1, the ranks span exactly that
    many nodes, num_devices_per_node on each (refused on a cluster with fewer); 1: packed onto as few as
    fit."""
    num_devices_per_node: int = Field(1, ge=1)
    """Processes (one GPU each on GPU clusters) per node."""

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_devices_per_node


class TrainedGroup(GroupShape):
    """A group that trains: its learning-rate schedule (stepped per optimizer step)."""

    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after the warmup: constant, or decayed linearly or along a cosine towards min_lr
    (reached at the step after the run's last)."""
    lr_warmup_ratio: float = Field(0.0, ge=0, le=1)
    """Linear warmup over this fraction of the run's optimizer steps."""
    lr_warmup_steps: int | None = Field(None, ge=0)
    """Linear warmup over this many optimizer steps (overrides lr_warmup_ratio)."""
    min_lr: float = Field(0.0, ge=0)
    """Floor of the linear and cosine decay."""

    @property
    def lr_scheduled(self) -> bool:
        """The learning rate follows a schedule whose curve depends on the run's length."""
        return self.lr_scheduler != "constant" or bool(self.lr_warmup_steps) or self.lr_warmup_ratio > 0

    def lr_schedule(self, lr: float, total_steps: int) -> LRSchedule:
        """The schedule over ``total_steps`` optimizer steps from the peak ``lr``."""
        warmup = self.lr_warmup_steps
        if warmup is None:
            warmup = math.ceil(self.lr_warmup_ratio * total_steps)
        return LRSchedule(
            kind=self.lr_scheduler,
            warmup_steps=warmup,
            total_steps=total_steps,
            min_lr_ratio=min(1.0, self.min_lr / lr),
        )


class ActorConfig(TrainedGroup):
    pretrain: str | None = None
    """Hugging Face folder of the policy; unset: the built-in demo (a tiny model built offline)."""
    lr: float = Field(2e-3, gt=0)
    """Actor learning rate; unset with --actor.pretrain: 1e-6 (the default here suits the demo's tiny model)."""
    model: ModelOptions = Field(default_factory=ModelOptions)
    """How the transformers model is built (attention kernel, gradient checkpointing, dtype)."""
    lora: LoraOptions | None = None
    """LoRA adapters on the actor (set any field, e.g. --actor.lora.rank 8, to switch it on)."""
    aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of a mixture-of-experts model's router auxiliary (load-balancing) loss in the policy loss
    (0: off; a model without a router loss is refused when it is set)."""


class CriticConfig(TrainedGroup):
    enable: bool | None = None
    """Run the critic group; unset: exactly when the estimator needs one (gae)."""
    pretrain: str | None = None
    """Folder the critic starts from (a causal LM gets a fresh value head); unset: the actor's."""
    lr: float = Field(1e-3, gt=0)
    """Critic learning rate; unset with --actor.pretrain: 9e-6."""
    model: ModelOptions = Field(default_factory=ModelOptions)
    """How the critic's transformers model is built."""


class RefConfig(GroupShape):
    pretrain: str | None = None
    """Reference policy folder, unused when no KL term is on; unset: the actor's starting weights."""


class TeacherConfig(GroupShape):
    pretrain: str | None = None
    """A teacher model folder that scores every token the policy samples (on-policy distillation,
    --algo.distill); it must share the policy's tokenizer; the same folder as --ref.pretrain loads once."""


class RewardConfig(GroupShape):
    func: Path | None = None
    """A .py file defining reward_func(queries, prompts, labels) (it is executed: trust it)."""
    pretrain: str | None = None
    """A reward-model folder (*ForSequenceClassification, one label), run as its own Ray group."""
    remote_url: list[str] = Field(default_factory=list)
    """HTTP reward endpoint(s), the flag repeated or a comma-separated list, with the bearer token in
    RLHF_REWARD_TOKEN sent along when set."""
    timeout_s: float = Field(60.0, gt=0)
    """Timeout of each request to a remote reward endpoint."""
    func_timeout_s: float | None = Field(None, gt=0)
    """Seconds one reward_func call (one batch) may take, then the run fails naming it; unset: no limit."""

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        given = [
            n
            for n, v in (("func", self.func), ("pretrain", self.pretrain), ("remote_url", self.remote_url))
            if v
        ]
        if len(given) > 1:
            raise ValueError(f"reward: choose one source, got {', '.join('--reward.' + g for g in given)}")
        return self

    @property
    def source(self) -> str | None:
        if self.func:
            return "func"
        if self.pretrain:
            return "model"
        if self.remote_url:
            return "remote"
        return None
