"""The asynchronous vLLM engine (``AsyncLLM``): a weight update lands mid-generation at a token
boundary (partial rollout), per-token version spans say which weights sampled which tokens, and the
generation after the update is what the new weights give for the prompt plus the tokens so far."""

from __future__ import annotations

import asyncio
import os

import pytest
from rlhf_rollout import AsyncVLLMEngine, SamplingParams, VersionSpan
from rollout_testutil import MAX_MODEL_LEN

ON_GPU = __import__("torch").cuda.is_available()
"""The module runs on either device: on a GPU it is partial rollout's GPU check (its tests take the lock)."""
pytestmark = [pytest.mark.gpu] if ON_GPU else []


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory, tiny_model_dir):
    """The tiny model's architecture with other random weights (what a training step would send)."""
    from rlhf_testkit import TinyModelSpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("other"), TinyModelSpec(seed=7))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def engine(loop, tiny_model_dir):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    async def start():
        return AsyncVLLMEngine(
            model=str(tiny_model_dir),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            worker_extension_cls="_file_weight_ext.FileWeightExtension",
            engine_kwargs={"enforce_eager": True, **({"gpu_memory_utilization": 0.2} if ON_GPU else {})},
        )

    eng = loop.run_until_complete(start())
    yield eng
    eng.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=120, ignore_eos=True)
PROMPT = [5, 17, 33, 48, 61]


def test_update_mid_generation_gives_two_spans_and_the_new_weights_continue(loop, engine, other_weights):
    async def scenario():
        await engine.init_weight_sync(
            transport="file", master_addr=str(other_weights), master_port=0, rank_offset=1, world_size=2
        )
        before = (await engine.generate([PROMPT], GREEDY))[0][0]
        report = None
        async for gens in engine.stream(PROMPT, GREEDY):
            if report is None and len(gens[0].token_ids) >= 16:
                await engine.pause(mode="keep")  # the request stays, frozen at a token boundary
                assert await engine.is_paused()
                report = await engine.receive_weights(timeout_s=60)
                await engine.resume()
        final = gens[0]
        k = final.weight_versions[0].end
        tail = (await engine.generate([PROMPT + final.token_ids[:k]], GREEDY))[0][0]
        return before, report, final, k, tail

    before, report, final, k, tail = loop.run_until_complete(asyncio.wait_for(scenario(), 300))
    n = len(final.token_ids)
    assert report["version"] == 1 and n == GREEDY.max_new_tokens
    assert 16 <= k < n
    assert final.weight_versions == (VersionSpan(0, 0, k), VersionSpan(1, k, n))
    assert final.token_ids[:k] == before.token_ids[:k]  # the old weights sampled the head
    assert final.token_ids[k:] == tail.token_ids[: n - k]  # the new weights, on prompt + head, the tail
    assert final.token_ids != before.token_ids  # the update changed what was generated
    assert tail.weight_versions == (VersionSpan(1, 0, len(tail.token_ids)),)


def test_a_call_seed_is_refused_where_calls_overlap(loop, engine):
    """The asynchronous engine's calls share its sampler while they run: ``seed_per_sample=False`` would
    give no reproducible tokens, so it is refused (a seed per sample is what it supports)."""
    p = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3, seed_per_sample=False)
    with pytest.raises(ValueError, match="seed_per_sample=False: the asynchronous engine"):
        loop.run_until_complete(engine.generate([PROMPT], p))
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=4, seed_per_sample=False)  # nothing to seed
    (row,) = loop.run_until_complete(engine.generate([PROMPT], unseeded))
    assert len(row[0].token_ids) > 0
