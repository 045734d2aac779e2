"""The CPU's fp32 against bf16 matrix-multiply speed, measured."""

import math
import time

import pytest
from rlhf_learner.hardware import MatmulSpeed, cpu_matmul_speed


def test_measures_both_dtypes_on_this_cpu():
    speed = cpu_matmul_speed(size=64, repeats=2)
    assert speed.size == 64
    for rate in (speed.fp32_gflops, speed.bf16_gflops):
        assert math.isfinite(rate) and rate > 0
    assert speed.bf16_slowdown == pytest.approx(speed.fp32_gflops / speed.bf16_gflops)


def test_each_rate_is_measured_in_its_own_dtype(monkeypatch):
    import torch

    seen, mm = [], torch.mm

    def slow_bf16(a, b):  # bf16 multiplies take 10 ms longer; fp32 ones as they are
        seen.append((a.dtype, b.dtype))
        if a.dtype == torch.bfloat16:
            time.sleep(0.01)
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", slow_bf16)
    speed = cpu_matmul_speed(size=16, repeats=2)
    assert seen == [(torch.float32, torch.float32)] * 3 + [(torch.bfloat16, torch.bfloat16)] * 3
    assert speed.bf16_gflops < 2 * 16**3 / 0.01 / 1e9 < speed.fp32_gflops


def test_slowdown_is_fp32_rate_over_bf16_rate():
    assert MatmulSpeed(size=256, fp32_gflops=140.0, bf16_gflops=1.4).bf16_slowdown == pytest.approx(100.0)
    assert MatmulSpeed(size=256, fp32_gflops=220.0, bf16_gflops=750.0).bf16_slowdown < 1


@pytest.mark.parametrize(("size", "repeats"), [(0, 1), (8, 0)])
def test_refuses_empty_measurements(size, repeats):
    with pytest.raises(ValueError, match="positive"):
        cpu_matmul_speed(size=size, repeats=repeats)
