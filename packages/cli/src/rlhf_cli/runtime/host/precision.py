"""A warning for bf16 asked of a CPU that multiplies bf16 matrices slowly.

On CPUs with AMX a bf16 step is faster than fp32; on an AVX2-only CPU PyTorch has no fast bf16 matrix
kernel and the same run is far slower than in fp32 (figures: docs/performance.md). The run still starts:
bf16 is a choice, not an error."""

from __future__ import annotations

from collections.abc import Callable

from rlhf_learner.hardware import MatmulSpeed, cpu_matmul_speed

from rlhf_cli.config import OfflineConfig, PPOConfig

__all__ = ["SLOW_BF16", "bf16_flags", "slow_bf16_note"]

SLOW_BF16 = 2.0
"""Warn when a bf16 matrix multiply takes this many times longer than an fp32 one."""


def bf16_flags(cfg: PPOConfig | OfflineConfig) -> list[str]:
    """The flags that ask for bf16 on the CPU: the learners' precision (which ``rlhf ppo``'s engines follow
    with ``--rollout.dtype auto``) and the engines' own dtype."""
    flags = ["--learner.precision bf16"] if cfg.learner.precision == "bf16" else []
    if isinstance(cfg, PPOConfig) and cfg.rollout.dtype == "bfloat16":
        flags.append("--rollout.dtype bfloat16")
    return flags


def slow_bf16_note(
    cfg: PPOConfig | OfflineConfig, *, gpus: int, measure: Callable[[], MatmulSpeed] | None = None
) -> str | None:
    """One line when a run on CPU (``gpus`` 0) asks for bf16 and this CPU multiplies bf16 matrices
    ``SLOW_BF16`` or more times slower than fp32 (``measure``d now, default ``cpu_matmul_speed``); else
    None."""
    flags = bf16_flags(cfg)
    if gpus or not flags:
        return None
    speed = (measure or cpu_matmul_speed)()
    if speed.bf16_slowdown < SLOW_BF16:
        return None
    return (
        f"{' and '.join(flags)}: this CPU multiplies bf16 matrices {speed.bf16_slowdown:.0f}x slower than fp32 "
        f"({speed.bf16_gflops:.1f} against {speed.fp32_gflops:.0f} GFLOP/s, measured now): "
        "fp32 is faster here"
    )
