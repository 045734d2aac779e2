"""Training backends behind one seam: typed options, the backend registry, distributed init, and the
``deepspeed`` (ZeRO) and ``fsdp2`` (torch ``fully_shard``) strategies with their gathers, checkpoints and
export."""

from rlhf_learner.strategy import _quiet  # noqa: F401 (drops a DeepSpeed notice; before its import)
from rlhf_learner.strategy._base import set_seed, unwrap_hf_model
from rlhf_learner.strategy.distributed import default_backend, free_port, init_distributed, reserve_port
from rlhf_learner.strategy.fsdp2 import FSDP2Engine, FSDP2Strategy  # registers "fsdp2"
from rlhf_learner.strategy.offload import offload_states, reload_states
from rlhf_learner.strategy.options import OptimizerName, Precision, StrategyOptions, build_ds_config
from rlhf_learner.strategy.registry import (
    TRAINING_BACKENDS,
    TrainingBackend,
    make_strategy,
    register_training_backend,
    training_backend,
)
from rlhf_learner.strategy.schedule import LRSchedule, SchedulerName, lr_factor, make_lr_scheduler
from rlhf_learner.strategy.strategy import Strategy, gather_params, mark_full_shapes  # registers "deepspeed"

DeepSpeedStrategy = Strategy

__all__ = [
    "TRAINING_BACKENDS",
    "DeepSpeedStrategy",
    "FSDP2Engine",
    "FSDP2Strategy",
    "LRSchedule",
    "OptimizerName",
    "Precision",
    "SchedulerName",
    "Strategy",
    "StrategyOptions",
    "TrainingBackend",
    "build_ds_config",
    "default_backend",
    "free_port",
    "gather_params",
    "init_distributed",
    "lr_factor",
    "make_lr_scheduler",
    "make_strategy",
    "mark_full_shapes",
    "offload_states",
    "register_training_backend",
    "reload_states",
    "reserve_port",
    "set_seed",
    "training_backend",
    "unwrap_hf_model",
]
