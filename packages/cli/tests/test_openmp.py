"""How long the idle OpenMP threads of a run's processes spin: set by the CLI before torch loads libgomp,
passed to every learner rank and engine, and the user's own setting wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rlhf_cli.runtime.host.openmp import SPIN_COUNT, openmp_env
from rlhf_cli.runtime.learners.group import worker_env

OPENMP = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


@pytest.fixture
def plain_env(monkeypatch):
    for name in OPENMP:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_ranks_and_engines_get_the_spin_count_unless_the_user_set_how_threads_wait(plain_env):
    assert worker_env()["GOMP_SPINCOUNT"] == str(SPIN_COUNT) and "OMP_WAIT_POLICY" not in worker_env()
    plain_env.setenv("GOMP_SPINCOUNT", "5")
    assert worker_env()["GOMP_SPINCOUNT"] == "5"
    plain_env.delenv("GOMP_SPINCOUNT")
    plain_env.setenv("OMP_WAIT_POLICY", "ACTIVE")  # libgomp would let a spin count override the policy
    assert worker_env()["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in worker_env()
    assert openmp_env({"OMP_WAIT_POLICY": "PASSIVE"}) == {}


def test_the_command_sets_it_before_torch_loads_openmp():
    env = {k: v for k, v in os.environ.items() if k not in OPENMP}
    code = "import os, sys, rlhf_cli.main; print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(SPIN_COUNT), "False"]  # torch not loaded yet: libgomp will read it
