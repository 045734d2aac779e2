"""One typed configuration tree per command: the single source of flags, YAML, --help and validation."""

from rlhf_cli.config.distill import DistillConfig
from rlhf_cli.config.loading import ConfigError, build_config, iter_fields, parse_flags
from rlhf_cli.config.offline import (
    DPOConfig,
    KTOConfig,
    LoraMergeConfig,
    OfflineConfig,
    RMConfig,
    ServeRMConfig,
    SFTConfig,
)
from rlhf_cli.config.ppo import PPOConfig
from rlhf_cli.config.printing import dump_yaml

__all__ = [
    "ConfigError",
    "DPOConfig",
    "DistillConfig",
    "KTOConfig",
    "LoraMergeConfig",
    "OfflineConfig",
    "PPOConfig",
    "RMConfig",
    "SFTConfig",
    "ServeRMConfig",
    "build_config",
    "dump_yaml",
    "iter_fields",
    "parse_flags",
]
