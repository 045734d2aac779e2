"""What a learner group runs and the settings its update steps take: plain, picklable data that crosses
the Ray boundary as itself."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from rlhf_learner import LoraOptions, ModelOptions, StrategyOptions
from rlhf_learner.strategy import LRSchedule

__all__ = [
    "DPOSettings",
    "DistillSettings",
    "ExportOptions",
    "GroupSpec",
    "KTOSettings",
    "PolicyLossSettings",
    "RankLayout",
    "Role",
    "ValueLossSettings",
    "group_strategy",
]

Role = Literal["actor", "critic", "ref", "reward"]


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """What one learner group runs."""

    role: Role
    model_path: str
    world_size: int
    strategy: StrategyOptions
    model: ModelOptions
    lora: LoraOptions | None = None
    temperature: float = 1.0
    """Sampling temperature: the actor and reference score tokens under the sampler's distribution."""
    trains: bool | None = None
    """Whether the group is trained; unset: the actor and critic are, the reference and reward model not."""
    cwd: str = field(default_factory=os.getcwd)
    """The driver's working folder: ranks work there (where it exists on their node), so relative paths
    in flags mean what they meant to the driver on a cluster it joined, as on one it started."""

    @property
    def trained(self) -> bool:
        return self.trains if self.trains is not None else self.role in ("actor", "critic")

    @functools.cached_property
    def text_vocab(self) -> int | None:
        """The model's vocabulary (the size of its logits; a multimodal model's text part), read once."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_path)
        return getattr(config.get_text_config(), "vocab_size", None)


@dataclass(frozen=True, kw_only=True)
class PolicyLossSettings:
    """Everything the policy update needs besides the micro-batches."""

    clip_eps_low: float
    clip_eps_high: float | None
    dual_clip: float | None
    ratio_type: str
    entropy_coef: float
    loss_agg: str
    horizon: int
    kl_estimator: str
    kl_loss_coef: float
    """0: no KL loss term."""
    is_correction: str
    is_low: float
    is_high: float
    aux_loss_coef: float = 0.0
    """Weight of a mixture-of-experts model's router auxiliary loss (0: off)."""
    distill: DistillSettings | None = None
    """Dense on-policy distillation's divergence from the teacher's top k (None: off)."""
    distill_coef: float = 0.0
    """Its weight in each action token's loss."""


@dataclass(frozen=True, kw_only=True)
class ValueLossSettings:
    clip_eps: float | None
    """Value clipping around the old values (None: off)."""


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """How one rank holds its model: its data shard, the blocks it splits work with, what it stores."""

    rank: int
    data_parallel_rank: int
    data_parallel_size: int
    sequence_parallel_size: int
    """Ranks that split each sequence (ring attention), 1: off."""
    tensor_parallel_size: int
    """Ranks that split each weight matrix (DeepSpeed AutoTP), 1: off."""
    attention: str
    """The transformers attention implementation the model runs."""
    local_params: int
    """Parameter elements this rank stores (less than the model's with tensor parallelism or ZeRO-3)."""


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """How the final Hugging Face folder is written (``--export.*``)."""

    dtype: str = "auto"
    """auto (the training dtype), bf16 or fp32."""
    max_shard_bytes: int = 5 * 2**30

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]


@dataclass(frozen=True, kw_only=True)
class DPOSettings:
    loss: str
    """dpo, ipo or cdpo."""
    beta: float
    label_smoothing: float
    nll_coef: float


@dataclass(frozen=True, kw_only=True)
class DistillSettings:
    loss: str
    """forward_kl, reverse_kl or jsd."""
    beta: float
    """jsd's teacher weight."""


@dataclass(frozen=True, kw_only=True)
class KTOSettings:
    beta: float
    desirable_weight: float
    undesirable_weight: float


def group_strategy(
    ds: StrategyOptions,
    *,
    lr: float,
    micro_batch_size: int,
    grad_accum_steps: int,
    seed: int,
    world_size: int,
    frozen: bool,
    lr_schedule: LRSchedule | None = None,
    keep_stage: bool = False,
) -> StrategyOptions:
    """A group's DeepSpeed options: ``--learner`` plus what the group sets; a frozen group (reference, reward
    model) runs as ``StrategyOptions.for_inference`` says, a trained one as ``for_ranks`` says (one rank:
    ZeRO-1/2 run as stage 0) unless ``keep_stage`` (its checkpoint holds ZeRO partitions, or its states
    are offloaded between phases, which needs a ZeRO optimizer)."""
    from dataclasses import replace

    options = replace(
        ds,
        lr=lr,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=max(1, grad_accum_steps),
        seed=seed,
        lr_schedule=lr_schedule or LRSchedule(),
    )
    if frozen:
        return options.for_inference()
    return options if keep_stage else options.for_ranks(world_size)
