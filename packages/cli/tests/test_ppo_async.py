"""Asynchronous ``rlhf ppo`` through the real stack, on one asynchronous vLLM-CPU engine (``AsyncLLM`` in
an async Ray actor): generation runs ahead of training within the staleness bound, partial rollout lands
updates mid-generation, and a resumed run trains every prompt exactly once. (The schedule itself, under
random delays, is tested in test_pipeline.py; the engine's mid-generation update in rlhf-rollout's
test_async_vllm.py.)"""

from __future__ import annotations

import json

import pytest
from rlhf_cli.config import PPOConfig, build_config
from rlhf_cli.ppo.recipe import run

FLAGS = [
    *("--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "12"),
    *("--train.micro_batch_size", "8", "--eval.every", "0", "--logger.progress", "false"),
    *("--vllm.max_model_len", "256", "--train.warmup_sft_steps", "1", "--ckpt.save_steps", "1"),
    *("--logger.tensorboard", "false", "--algo.advantage.estimator", "group_norm"),
]


@pytest.fixture(scope="module")
def async_engine(ray_cluster, demo_model_dir):
    from rlhf_cli.ppo.components import WORKER_EXTENSION
    from rlhf_rollout import EngineClient, create_engines

    (handle,) = create_engines(
        num_engines=1,
        backend="vllm",
        engine_kwargs=dict(
            model=str(demo_model_dir),
            dtype="float32",
            max_model_len=256,
            seed=0,
            worker_extension_cls=WORKER_EXTENSION["vllm"],
            engine_kwargs={"enforce_eager": True},
        ),
        num_cpus_per_engine=0.25,
        env_vars={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        asynchronous=True,
    )
    yield EngineClient([handle])
    try:
        ray_cluster.get(handle.shutdown.remote(), timeout=60)
    finally:
        ray_cluster.kill(handle, no_restart=True)


def ppo(run_dir, engines, *flags):
    return run(build_config(PPOConfig, [*FLAGS, "--logger.run_dir", str(run_dir), *flags]), engines=engines)


def cursor_at(run_dir, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "run_state.json").read_text())["cursor"]


def test_async_then_partial_rollout_resumed_trains_each_prompt_once_within_the_bound(tmp_path, async_engine):
    first = ppo(tmp_path / "run", async_engine, "--train.num_steps", "2", "--train.async.max_staleness", "1")
    rows = first.history
    assert rows[0]["sync/staleness_max"] == 0.0 and rows[0]["rollout/weight_version"] == 1.0
    for step, r in enumerate(rows, start=1):  # non-partial: a batch's samples share one version
        assert r["sync/staleness_max"] == r["sync/staleness_mean"] == step - r["rollout/weight_version"]
        assert r["sync/staleness_max"] <= 1.0
    assert [r["sync/weight_version"] for r in rows] == [2.0, 3.0]
    # the producer ran ahead, but the checkpoint holds where the trained batches end: 2 x 4 prompts
    assert cursor_at(first.run_dir, 2) == {"epoch": 0, "index": 8}
    second = ppo(
        tmp_path / "run",
        async_engine,
        *("--train.num_steps", "4", "--ckpt.load_enable"),
        *("--train.async.max_staleness", "2", "--train.async.partial_rollout"),
    )
    rows = second.history[2:]
    assert [r["step"] for r in rows] == [3, 4]
    assert cursor_at(second.run_dir, 3) == {"epoch": 0, "index": 12}  # batch 3 is the prompts after batch 2
    assert cursor_at(second.run_dir, 4) == {"epoch": 0, "index": 16}
    for r in rows:
        assert 0.0 <= r["sync/staleness_max"] <= 2.0
        assert r["sync/staleness_0_frac"] + r["sync/staleness_1_frac"] + r["sync/staleness_2_frac"] == 1.0
        assert r["rollout/response_length"] > 0
    assert [r["sync/weight_version"] for r in rows] == [4.0, 5.0]
