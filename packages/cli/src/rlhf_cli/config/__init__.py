"""One typed configuration tree per command: the single source of flags, YAML, --help and validation."""

from rlhf_cli.config.loading import ConfigError, build_config, dump_yaml, iter_fields, parse_flags
from rlhf_cli.config.ppo import PPOConfig

__all__ = ["ConfigError", "PPOConfig", "build_config", "dump_yaml", "iter_fields", "parse_flags"]
