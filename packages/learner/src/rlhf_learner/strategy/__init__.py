"""DeepSpeed strategy: typed options, config builder, distributed init, gather, checkpoints, export."""

from rlhf_learner.strategy.distributed import default_backend, free_port, init_distributed, reserve_port
from rlhf_learner.strategy.offload import offload_states, reload_states
from rlhf_learner.strategy.options import OptimizerName, Precision, StrategyOptions, build_ds_config
from rlhf_learner.strategy.schedule import LRSchedule, SchedulerName, lr_factor, make_lr_scheduler
from rlhf_learner.strategy.strategy import Strategy, gather_params, set_seed, unwrap_hf_model

__all__ = [
    "LRSchedule",
    "OptimizerName",
    "Precision",
    "SchedulerName",
    "Strategy",
    "StrategyOptions",
    "build_ds_config",
    "default_backend",
    "free_port",
    "gather_params",
    "init_distributed",
    "lr_factor",
    "make_lr_scheduler",
    "offload_states",
    "reload_states",
    "reserve_port",
    "set_seed",
    "unwrap_hf_model",
]
