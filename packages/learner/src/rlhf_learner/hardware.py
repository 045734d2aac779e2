"""What this machine's CPU does with bf16: measured, since CPU flags alone do not say how fast it is.

On CPUs with AMX a bf16 matrix multiply is several times faster than an fp32 one; on an AVX2-only CPU
PyTorch has no fast bf16 kernel and it is far slower. A run's precision choice asks this module instead of
guessing from the CPU's flags."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["MatmulSpeed", "cpu_matmul_speed"]


@dataclass(frozen=True)
class MatmulSpeed:
    """Square matrix multiplies on this CPU, fp32 against bf16, with the calling thread's torch threads."""

    size: int
    fp32_gflops: float
    bf16_gflops: float

    @property
    def bf16_slowdown(self) -> float:
        """How many times longer a bf16 multiply takes than an fp32 one (below 1: bf16 is faster)."""
        return self.fp32_gflops / self.bf16_gflops


def cpu_matmul_speed(size: int = 256, repeats: int = 3) -> MatmulSpeed:
    """Time ``size x size`` matrix multiplies in fp32 and bf16 on the CPU: the best of ``repeats`` after
    one warm-up each (``size`` 256 keeps it short where bf16 is slow)."""
    if size < 1 or repeats < 1:
        raise ValueError(f"size and repeats must be positive, got {size} and {repeats}")
    flops = 2.0 * size**3
    rates = {}
    noise = torch.Generator().manual_seed(0)  # the caller's random state is left as it was
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size, generator=noise).to(dtype)
        b = torch.randn(size, size, generator=noise).to(dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        rates[dtype] = flops / max(best, 1e-9) / 1e9
    return MatmulSpeed(size=size, fp32_gflops=rates[torch.float32], bf16_gflops=rates[torch.bfloat16])
