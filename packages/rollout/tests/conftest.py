"""Shared fixtures: one Ray cluster, one vLLM engine (inside a Ray actor), one transformers engine,
per test session. Reference logprobs come from a plain transformers forward."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray otherwise re-runs `uv run` (a fresh project venv) for every worker when the driver runs under uv.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import sys

import pytest
import torch

TESTS_DIR = Path(__file__).parent
sys.path.insert(0, str(TESTS_DIR))  # for rollout_testutil and the test worker extension

from rollout_testutil import MAX_MODEL_LEN  # noqa: E402

ON_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_engine(tiny_model_dir):
    from rlhf_rollout import TransformersEngine

    return TransformersEngine(model=tiny_model_dir, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if ray.is_initialized():  # another package's tests in the same session started one: share it
        yield ray
        return
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def vllm_client(ray_cluster, tiny_model_dir):
    """The session's only vLLM engine, in a Ray actor, with a test worker extension
    (``_file_weight_ext.FileWeightExtension``) that loads weights from a folder."""
    from rlhf_rollout import EngineClient, create_engines

    (engine,) = create_engines(
        num_engines=1,
        backend="vllm",
        engine_kwargs=dict(
            model=str(tiny_model_dir),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            seed=0,
            worker_extension_cls="_file_weight_ext.FileWeightExtension",
            engine_kwargs={"enforce_eager": True},  # no torch.compile start-up
            **({"gpu_memory_utilization": 0.3} if ON_CUDA else {}),
        ),
        num_cpus_per_engine=0.5,
        num_gpus_per_engine=0.4 if ON_CUDA else 0.0,
        env_vars={
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
        },
    )
    client = EngineClient([engine])
    yield client
    import ray

    ray.get(engine.shutdown.remote())
    ray.kill(engine)
