"""How a run stops its rollout engines: one still starting (a run that failed or was interrupted during
start-up) is killed at once, since a call to it would wait behind its start-up; one that has started is
shut down, then killed."""

from __future__ import annotations

import time

import pytest


def test_an_engine_still_starting_is_killed_at_once_and_a_started_one_shut_down(ray_cluster, demo_model_dir):
    import ray
    from ray.exceptions import RayActorError
    from rlhf_cli.ppo.engine_restarts import stop_engine as _stop_engine
    from rlhf_rollout import create_engines, engines_started

    def launch():
        (handle,) = create_engines(
            wait=False,
            num_engines=1,
            backend="transformers",
            engine_kwargs=dict(model=str(demo_model_dir), max_model_len=256),
            num_cpus_per_engine=0.25,
            env_vars={"OMP_NUM_THREADS": "1"},
        )
        return handle, engines_started([handle])[0]

    starting, started = launch()
    _stop_engine(starting, started=started)
    with pytest.raises(RayActorError):  # killed before it had started: it never answered
        ray.get(started, timeout=60)

    running, ready = launch()
    assert ray.get(ready, timeout=300) == 256
    _stop_engine(running, started=ready)
    # ray.kill is asynchronous: the actor dies soon after it returns (a call may still get in first)
    deadline = time.monotonic() + 60
    with pytest.raises(RayActorError):
        while time.monotonic() < deadline:
            ray.get(running.max_model_len.remote(), timeout=60)
            time.sleep(0.2)
