"""The examples in examples/ run as they are: rlhf-algos alone, rlhf-weightsync from a plain PyTorch
loop and from a transformers Trainer into a running rollout engine (each in its own process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    ("script", "expect"),
    [
        ("algos_only.py", "policy loss"),
        ("weightsync_plain_torch.py", "engine holds version 3"),
        ("weightsync_hf_trainer.py", "versions loaded by the engine: [1, 2, 3, 4]"),
    ],
)
def test_example_runs(script, expect, tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert expect in out.stdout, out.stdout[-2000:]
