"""Engine actors on a Ray placement group serving one batch; async generation."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from rlhf_rollout import EngineClient, SamplingParams, TransformersEngine, create_engines
from rollout_testutil import PROMPTS


@pytest.fixture(scope="module")
def two_hf_engines(ray_cluster, tiny_model_dir):
    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}], strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    engines = create_engines(
        num_engines=2,
        backend="transformers",
        engine_kwargs=dict(model=str(tiny_model_dir), max_model_len=512),
        placement_group=pg,
        bundle_indices=[1, 0],
        num_cpus_per_engine=0.5,
        env_vars={"OMP_NUM_THREADS": "1"},
    )
    yield pg, engines
    for e in engines:
        ray.kill(e)
    remove_placement_group(pg)


def test_two_actors_on_a_placement_group_serve_one_batch(two_hf_engines, tiny_model_dir):
    pg, engines = two_hf_engines
    table = ray.util.placement_group_table(pg)
    assert table["state"] == "CREATED"

    client = EngineClient(engines)
    prompts = PROMPTS * 2  # 8 prompts: 4 per engine
    p = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=21)
    out = client.generate(prompts, p)
    assert len(out) == 8 and all(len(row) == 2 for row in out)
    # Each shard equals what a local engine gives for the same shard and shard seed.
    local = TransformersEngine(model=tiny_model_dir, max_model_len=512)
    expect = local.generate(prompts[:4], p) + local.generate(prompts[4:], replace(p, seed=21 + 4 * 2))
    assert [[g.token_ids for g in r] for r in out] == [[g.token_ids for g in r] for r in expect]
    # Both actors really sit in the placement group.
    ids = ray.get(
        [
            e.__ray_call__.remote(lambda self: ray.get_runtime_context().get_placement_group_id())
            for e in engines
        ]
    )
    assert ids == [pg.id.hex()] * 2


def test_async_generation_lets_scoring_run_meanwhile(two_hf_engines):
    _, engines = two_hf_engines
    client = EngineClient(engines)
    p = SamplingParams(temperature=1.0, max_new_tokens=64, n=4, seed=1, ignore_eos=True)

    async def main():
        loop = asyncio.get_running_loop()
        ticks: list[float] = []

        async def generate():
            out = await client.agenerate(PROMPTS, p)
            return out, loop.time()

        async def other_work():
            for _ in range(5):
                ticks.append(loop.time())
                await asyncio.sleep(0.01)

        (gen, done_at), _ = await asyncio.gather(generate(), other_work())
        return gen, done_at, ticks

    gen, done_at, ticks = asyncio.run(main())
    assert len(ticks) == 5 and ticks[-1] < done_at  # the loop kept running while engines generated
    assert gen == client.generate(PROMPTS, p)


def test_create_engines_rejects_bad_placement(ray_cluster, tiny_model_dir):
    with pytest.raises(ValueError, match="bundle_indices needs a placement_group"):
        create_engines(num_engines=1, backend="transformers", engine_kwargs={}, bundle_indices=[0])
    with pytest.raises(ValueError, match="the transformers rollout backend does not shard a model"):
        create_engines(num_engines=1, backend="transformers", engine_kwargs={}, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"engine_kwargs\['tensor_parallel_size'\]=2 differs"):
        create_engines(num_engines=1, backend="vllm", engine_kwargs={"tensor_parallel_size": 2})


def test_a_sharded_engine_takes_vllms_ray_executor_on_gpus_and_child_processes_on_cpu(ray_cluster):
    from types import SimpleNamespace

    from rlhf_rollout.engine_setup import engine_arguments, on_gpus

    gpu_bundles = SimpleNamespace(bundle_specs=[{"CPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}])
    assert on_gpus(gpu_bundles, [1, 2], 0.0) and not on_gpus(gpu_bundles, [0], 0.0)
    assert on_gpus(None, None, 0.5)  # the actor asks for GPUs
    assert on_gpus(None, None, 0.0) == (ray.cluster_resources().get("GPU", 0) > 0)

    def executor(tp: int, gpu: bool) -> str:
        return engine_arguments(backend="vllm", engine_kwargs={}, tp=tp, gpu=gpu)[
            "distributed_executor_backend"
        ]

    assert (executor(2, True), executor(2, False), executor(1, True), executor(1, False)) == (
        "ray",
        "mp",
        "uni",
        "uni",
    )


def test_engines_not_waited_for_return_while_they_start_and_their_start_up_errors_surface(
    ray_cluster, tiny_model_dir, tmp_path
):
    """``create_engines(wait=False)`` hands back the actors at once (what a caller does meanwhile overlaps
    the engines' start-up); ``engines_started`` resolves once each has started, or fails with its
    start-up error."""
    from rlhf_rollout import engines_started

    def launch(model):
        return create_engines(
            wait=False,
            num_engines=1,
            backend="transformers",
            engine_kwargs=dict(model=str(model), max_model_len=384),
            num_cpus_per_engine=0.25,
            env_vars={"OMP_NUM_THREADS": "1"},
        )

    launched = []
    try:
        good = launch(tiny_model_dir)
        launched += good
        bad = launch(tmp_path / "no_such_model")
        launched += bad
        ready, _ = ray.wait(engines_started(good), timeout=0)
        assert not ready  # a new process has not imported and loaded its engine yet
        assert ray.get(engines_started(good), timeout=300) == [384]
        with pytest.raises(ray.exceptions.RayActorError, match="no_such_model"):
            ray.get(engines_started(bad), timeout=300)
    finally:
        for h in launched:
            ray.kill(h, no_restart=True)


class _Replacer:
    """Starts a transformers engine in the dead one's bundle (the weights are the model folder's: no
    trainer here), and records what it was asked."""

    def __init__(self, pg, model_dir) -> None:
        self.pg, self.model_dir = pg, model_dir
        self.lock = threading.RLock()
        self.started: list[int] = []
        self.loads: list[list] = []
        self.made: list = []

    def start(self, index: int, error: BaseException) -> object:
        self.started.append(index)
        (engine,) = create_engines(
            num_engines=1,
            backend="transformers",
            engine_kwargs=dict(model=str(self.model_dir), max_model_len=512),
            placement_group=self.pg,
            bundle_indices=[[1, 0][index]],
            num_cpus_per_engine=0.5,
            env_vars={"OMP_NUM_THREADS": "1"},
        )
        self.made.append(engine)
        return engine

    def load_weights(self, engines) -> None:
        self.loads.append(list(engines))


def test_an_engine_that_dies_mid_call_is_replaced_and_its_shard_generated_again(
    two_hf_engines, tiny_model_dir
):
    """An engine killed while it serves its shard: the client starts another in its place (through the
    replacer), which generates that shard again with the shard's seed, so the batch equals an uninterrupted
    one, in the blocking and the asynchronous call; past ``max_replacements`` the death is raised, as is
    an error that is not a death."""
    from rlhf_rollout import engine_death
    from rlhf_rollout.engine_faults import EngineFaults

    pg, engines = two_hf_engines
    p = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=5)
    prompts = PROMPTS * 2
    expected = EngineClient(engines).generate(prompts, p)
    replacer = _Replacer(pg, tiny_model_dir)
    client = EngineClient(list(engines), replacer=replacer, max_replacements=2)
    try:
        calls = client.submit(client.shards(prompts, p)[0])  # engine 0 busy, then killed mid-call
        ray.kill(client.engines[0])
        assert client.generate(prompts, p) == expected
        with pytest.raises(ray.exceptions.RayActorError) as dead:
            ray.get(calls[1], timeout=60)
        assert engine_death(dead.value)
        ray.kill(client.engines[1])  # the asynchronous call, on the other engine
        assert asyncio.run(client.agenerate(prompts, p)) == expected
        assert replacer.started == [0, 1] and [len(e) for e in replacer.loads] == [2, 2]
        assert replacer.loads[1] == client.engines and replacer.loads[0][0] is client.engines[0]
        assert client.faults.restarts == 2 and client.faults.seconds_lost > 0
        assert set(EngineFaults(restarts=2, seconds_lost=1.0).metrics()) == {
            "fault/engine_restarts",
            "fault/engine_seconds_lost",
        }
        with pytest.raises(ray.exceptions.RayTaskError) as failed:  # a call's own error: raised, not healed
            client.generate([[]], p)
        assert not engine_death(failed.value)
        ray.kill(client.engines[0])  # one death more than allowed
        with pytest.raises(ray.exceptions.RayActorError):
            client.generate(prompts, p)
        assert replacer.started == [0, 1]
    finally:
        for e in replacer.made:
            ray.kill(e)
