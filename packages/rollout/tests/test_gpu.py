"""CUDA-only paths (skipped without CUDA): vLLM sleep mode, and tensor parallelism over Ray (its
samples' log-probs are the model's). Partial rollout on GPU: test_async_vllm.py runs on either device."""

from __future__ import annotations

import pytest
import torch
from rlhf_rollout import SamplingParams
from rollout_testutil import PROMPTS, reference_logprobs


@pytest.mark.gpu
def test_vllm_sleep_and_wake_keep_generation(tiny_model_dir, hf_model):
    from rlhf_rollout import VLLMEngine

    engine = VLLMEngine(
        model=str(tiny_model_dir),
        dtype="float32",
        max_model_len=512,
        enable_sleep_mode=True,
        gpu_memory_utilization=0.2,
    )
    try:
        assert engine.capabilities.sleep and engine.capabilities.backend == "vllm"
        p = SamplingParams(temperature=0.8, max_new_tokens=16, n=2, seed=1)
        before = engine.generate(PROMPTS, p)
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep(level=1)
        assert torch.cuda.mem_get_info()[0] > free_awake  # memory really went back
        engine.wake_up()
        after = engine.generate(PROMPTS, p)
        assert [[g.token_ids for g in r] for r in before] == [[g.token_ids for g in r] for r in after]
        g = after[0][0]
        ref = reference_logprobs(hf_model, PROMPTS[0], g.token_ids, temperature=0.8)
        assert (ref - torch.tensor(g.logprobs, dtype=ref.dtype)).abs().max() < 2e-3
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_levels_then_weights_then_cache_give_the_outputs_of_no_sleep(tiny_model_dir, level):
    """The hybrid engine's phases: sleep (level 2 drops the weights), wake the weights, load weights
    (what a push does), wake the KV cache: greedy outputs equal those before any sleep."""
    from rlhf_rollout import VLLMEngine

    engine = VLLMEngine(
        model=str(tiny_model_dir),
        dtype="float32",
        max_model_len=512,
        enable_sleep_mode=True,
        gpu_memory_utilization=0.2,
    )
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
        before = engine.generate(PROMPTS, greedy)
        free_awake = torch.cuda.mem_get_info()[0]
        engine.sleep(level=level)
        free_asleep = torch.cuda.mem_get_info()[0]
        assert free_asleep > free_awake  # released
        engine.wake_up(tags=["weights"])
        engine.reload_weights_from_path(path=str(tiny_model_dir))  # level 2 needs them back
        engine.wake_up(tags=["kv_cache"])
        assert torch.cuda.mem_get_info()[0] < free_asleep  # restored
        after = engine.generate(PROMPTS, greedy)
        assert [[g.token_ids for g in r] for r in before] == [[g.token_ids for g in r] for r in after]
    finally:
        engine.shutdown()


@pytest.mark.gpu
def test_vllm_tensor_parallel_engine_on_a_placement_group(ray_cluster, tiny_model_dir, hf_model):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for tensor_parallel_size=2")
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from rlhf_rollout import EngineClient, create_engines

    pg = placement_group([{"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}], strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    (engine,) = create_engines(
        num_engines=1,
        backend="vllm",
        tensor_parallel_size=2,
        engine_kwargs=dict(
            model=str(tiny_model_dir), dtype="float32", max_model_len=512, gpu_memory_utilization=0.2
        ),
        placement_group=pg,
        num_cpus_per_engine=0.2,
    )
    try:
        out = EngineClient([engine], tensor_parallel_size=2).generate(
            PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=8, n=2, seed=3)
        )
        assert len(out) == len(PROMPTS) and all(len(r) == 2 for r in out)
        for prompt, r in zip(PROMPTS, out, strict=True):  # two shards compute the one model's numbers
            for g in r:
                ref = reference_logprobs(hf_model, prompt, g.token_ids, temperature=0.8)
                assert (ref - torch.tensor(g.logprobs, dtype=ref.dtype)).abs().max() < 2e-3
    finally:
        ray.kill(engine)
        remove_placement_group(pg)
