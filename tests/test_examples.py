"""The examples in examples/ run as they are: rlhf-algos alone, rlhf-weightsync from a plain PyTorch
loop and from a transformers Trainer into a running rollout engine, a multi-turn environment playing a
scripted episode (each in its own process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize(
    ("script", "expect"),
    [
        ("algos_only.py", "policy loss"),
        ("weightsync_plain_torch.py", "engine holds version 3"),
        ("weightsync_hf_trainer.py", "versions loaded by the engine: [1, 2, 3, 4]"),
        ("multi_turn_env.py", "episode reward: 0.33"),
    ],
)
def test_example_runs(script, expect, tmp_path):
    # as a user runs it: not inside another job's process group (tests of this session that set up
    # torch.distributed in-process leave RANK / MASTER_PORT / ... in os.environ, and transformers'
    # Trainer would join that group through accelerate)
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert expect in out.stdout, out.stdout[-2000:]
