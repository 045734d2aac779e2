"""Shared fixtures: a world-of-one process group in the test process, and the multi-rank run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multirank_worker.py")


@pytest.fixture(scope="session")
def dist_single():
    """Join a gloo group of one (DeepSpeed engines need a process group even on one rank)."""
    from rlhf_learner.strategy import init_distributed

    return init_distributed(timeout_s=120)


def _free_port() -> int:
    from rlhf_learner.strategy import free_port

    return free_port()


def run_ranks(
    world: int,
    model_dir: Path,
    out: Path,
    timeout_s: float = 400,
    *,
    worker: Path = WORKER,
    args: tuple[str, ...] = (),
    results: str = "results",
) -> list[dict]:
    """Run ``worker`` (default ``multirank_worker.py``) as ``world`` processes over gloo on 127.0.0.1 with
    ``args``; return each rank's results (``out/<results>_w<world>_r<rank>.json``)."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
                "--model",
                str(model_dir),
                "--out",
                str(out),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise AssertionError(f"rank {r}/{world} failed (exit {p.returncode}):\n{logs[r][-4000:]}")
    return [json.loads((out / f"{results}_w{world}_r{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="session")
def multirank(tiny_model_dir, tmp_path_factory):
    """One single-process ZeRO-0 run and one 2-rank run (ZeRO-2, ZeRO-3 + checkpoint + export, ring
    attention), shared by the distributed tests."""
    out = tmp_path_factory.mktemp("multirank")
    single = run_ranks(1, tiny_model_dir, out)
    double = run_ranks(2, tiny_model_dir, out)
    return {"out": out, "w1": single, "w2": double}


@pytest.fixture(scope="session")
def multirank4(multirank, tiny_model_dir):
    """A 4-rank run of sequence-parallel SFT only: 2 data-parallel groups of 2 sequence-parallel ranks."""
    return run_ranks(4, tiny_model_dir, multirank["out"])


@pytest.fixture(scope="session")
def fsdp2_runs(multirank, tiny_model_dir):
    """The fsdp2 backend on 1 and 2 ranks (training, checkpoint, export, sequence parallel, LoRA), then
    each world size resuming the other's checkpoint; beside ``multirank``'s DeepSpeed runs."""
    out = multirank["out"]
    worker = WORKER.with_name("fsdp2_worker.py")
    runs = {}
    for world in (1, 2):
        runs[f"w{world}"] = run_ranks(world, tiny_model_dir, out, worker=worker, results="fsdp2_train")
    for world in (1, 2):
        runs[f"resume_w{world}"] = run_ranks(
            world, tiny_model_dir, out, worker=worker, args=("--scenario", "resume"), results="fsdp2_resume"
        )
    return {"out": out, **runs}
