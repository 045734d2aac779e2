"""Typed training options (backend-neutral, with the DeepSpeed config builder)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from rlhf_learner.strategy.registry import training_backend
from rlhf_learner.strategy.schedule import LRSchedule

__all__ = ["OptimizerName", "Precision", "StrategyOptions", "build_ds_config"]

Precision = Literal["fp32", "bf16"]
OptimizerName = Literal["adamw", "muon"]


@dataclass(kw_only=True)
class StrategyOptions:
    """How one model is trained (or served for inference), and by which training backend."""

    backend: str = "deepspeed"
    """Training backend: ``deepspeed`` (ZeRO 0-3, AutoTP) or ``fsdp2`` (torch ``fully_shard``; zero_stage 3
    frees gathered layers after their forward, 0-2 keep them for the backward)."""
    zero_stage: int = 2
    """ZeRO stage: 0 (plain data parallel), 1 (optimizer states sharded), 2 (+ gradients), 3 (+ parameters).
    Stages 1 and 2 shard nothing on a single rank (``for_ranks`` runs them as 0 there). On fsdp2, 3 is full
    sharding (layers resharded after their forward) and 0-2 shard but keep gathered layers for the backward."""
    offload_optimizer: bool = False
    """Keep optimizer states (and the optimizer step) on the CPU (ZeRO-Offload; needs zero_stage >= 1)."""
    offload_params: bool = False
    """Keep parameters on the CPU between uses (ZeRO-Infinity; fsdp2's ``CPUOffloadPolicy``; needs
    zero_stage == 3)."""
    precision: Precision = "fp32"
    """Training precision: ``fp32`` or ``bf16`` (bf16 weights and activations, fp32 master weights)."""
    micro_batch_size: int = 1
    """Rows per micro-batch per data-parallel rank (DeepSpeed's ``train_micro_batch_size_per_gpu``)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; every update step must get exactly this many."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; ``None`` disables clipping."""
    optimizer: OptimizerName = "adamw"
    """``adamw`` (torch's AdamW under DeepSpeed: no compiler needed on CPU) or ``muon`` (DeepSpeed's
    Muon for matrices with an AdamW half for the rest, where the installed DeepSpeed has it)."""
    lr: float = 1e-5
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    tensor_parallel_size: int = 1
    """DeepSpeed AutoTP training degree (1 = off). Needs zero_stage <= 2."""
    sequence_parallel_size: int = 1
    """Ranks that split one sequence with ring attention (1 = off)."""
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    """Learning-rate schedule, stepped per optimizer step (constant: the plain ``lr``)."""
    seed: int = 42
    """Seed for torch / random on every rank."""
    timeout_s: float = 600.0
    """Timeout of every collective (distributed init, all-reduce, ring exchange)."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str):
            raise ValueError(f"backend: expected a name, got {self.backend!r}")
        backend = training_backend(self.backend)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage: expected 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(
                f"offload_params: parameter offload needs zero_stage=3, got zero_stage={self.zero_stage}"
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer: optimizer offload needs zero_stage >= 1, got zero_stage=0")
        if self.precision not in get_args(Precision):
            raise ValueError(f"precision: expected one of {get_args(Precision)}, got {self.precision!r}")
        if self.optimizer not in get_args(OptimizerName):
            raise ValueError(f"optimizer: expected one of {get_args(OptimizerName)}, got {self.optimizer!r}")
        for name in (
            "micro_batch_size",
            "grad_accum_steps",
            "tensor_parallel_size",
            "sequence_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip: expected a positive number or None, got {self.grad_clip}")
        if self.lr <= 0:
            raise ValueError(f"lr: expected a positive learning rate, got {self.lr}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {self.timeout_s}")
        if self.tensor_parallel_size > 1 and self.zero_stage == 3:
            raise ValueError("tensor_parallel_size: DeepSpeed AutoTP training supports zero_stage 0-2, not 3")
        if self.tensor_parallel_size > 1 and self.sequence_parallel_size > 1:
            raise ValueError("tensor_parallel_size and sequence_parallel_size cannot both be > 1 here")
        backend.check_options(self)

    def for_inference(self) -> StrategyOptions:
        """These options for a frozen model (reference, reward model: no optimizer or gradients).

        With ZeRO-1/2 a frozen model runs as plain replicas (stage 0, no optimizer offload): there is
        nothing to shard. ZeRO-3 still shards its parameters (and keeps parameter offload). Everything
        else (precision, tensor / sequence parallel sizes, seed, timeout) is kept.
        """
        stage = 0 if self.zero_stage in (1, 2) else self.zero_stage
        return replace(self, zero_stage=stage, offload_optimizer=False)

    def for_ranks(self, world_size: int) -> StrategyOptions:
        """These options for a trained model on ``world_size`` ranks.

        On a single rank ZeRO-1/2 shard nothing and only add their partitioned optimizer's bookkeeping to
        every step (on 2 CPU cores about a quarter of a 23M bf16 update), so they run as stage 0. Kept as
        they are: optimizer offload (it needs ZeRO), and bf16 with gradient accumulation (stage 0 sums
        the micro-batches' gradients in bf16, ZeRO in fp32).
        """
        bf16_sums = self.precision == "bf16" and self.grad_accum_steps > 1
        if world_size == 1 and self.zero_stage in (1, 2) and not self.offload_optimizer and not bf16_sums:
            return replace(self, zero_stage=0)
        return self


def require_muon() -> None:
    try:
        from deepspeed.runtime.config import MUON_OPTIMIZER  # noqa: F401
    except ImportError as e:
        raise ValueError("optimizer='muon': the installed DeepSpeed has no Muon optimizer") from e


def require_autotp() -> None:
    try:
        from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig

        ok = "autotp_size" in TPTrainingConfig.model_fields
    except ImportError:
        ok = False
    if not ok:
        raise ValueError("tensor_parallel_size: the installed DeepSpeed has no AutoTP training")


def build_ds_config(options: StrategyOptions, *, train: bool = True) -> dict[str, Any]:
    """The DeepSpeed config dict for ``options``.

    ``train=False`` gives an inference config (no optimizer; ZeRO-3 still shards parameters, which is
    how a large frozen reference model is spread over ranks).
    """
    zero: dict[str, Any] = {"stage": options.zero_stage}
    if options.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if options.offload_optimizer and train:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if options.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": options.micro_batch_size,
        "gradient_accumulation_steps": options.grad_accum_steps,
        "zero_optimization": zero,
        "bf16": {"enabled": options.precision == "bf16"},
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if train:
        config["gradient_clipping"] = options.grad_clip or 0.0
        params = {
            "lr": options.lr,
            "betas": list(options.betas),
            "eps": options.eps,
            "weight_decay": options.weight_decay,
            "torch_adam": True,
        }
        if options.optimizer == "adamw":  # torch's one-kernel AdamW, not its per-op loop
            config["optimizer"] = {"type": "AdamW", "params": params | {"fused": True}}
        else:
            config["optimizer"] = {"type": "Muon", "params": params}
    if options.tensor_parallel_size > 1:
        config["tensor_parallel"] = {"autotp_size": options.tensor_parallel_size}
    return config
