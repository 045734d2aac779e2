"""vLLM specifics through the session's engine actor: honest capabilities, weight-update forwarding
to a worker extension (with the prefix-cache reset), and loading a checkpoint folder."""

from __future__ import annotations

import pytest
import ray
import torch
from rlhf_rollout import SamplingParams, UnsupportedOperationError, WeightSyncReport
from rollout_testutil import reference_logprobs

LONG_PROMPT = [1] + [40 + (i * 7) % 200 for i in range(47)]  # 3 full KV blocks: the prefix cache holds it


def test_capabilities_say_what_is_missing(vllm_client):
    (caps,) = vllm_client.capabilities()
    assert caps.backend == ("vllm" if torch.cuda.is_available() else "vllm-cpu")
    assert not caps.sleep and caps.weight_sync_extension and caps.prefix_cache and not caps.load_weights
    reason = "needs enable_sleep_mode=True" if torch.cuda.is_available() else "CPU backend has no sleep mode"
    assert reason in caps.notes
    engine = vllm_client.engines[0]
    with pytest.raises(UnsupportedOperationError, match=reason):
        ray.get(engine.sleep.remote(level=1))
    with pytest.raises(UnsupportedOperationError, match=reason):
        ray.get(engine.wake_up.remote())
    with pytest.raises(
        UnsupportedOperationError, match="load_weights is not supported: weights go through init_weight_sync"
    ):
        ray.get(engine.load_weights.remote(named_tensors=[]))


def _logprobs(client, temperature=0.8):
    (row,) = client.generate([LONG_PROMPT], SamplingParams(temperature=temperature, max_new_tokens=8, seed=1))
    return row[0]


def test_weight_sync_forwarding_reloads_and_resets_prefix_cache(
    vllm_client, hf_model, tiny_model_dir, tmp_path
):
    engine = vllm_client.engines[0]
    g = _logprobs(vllm_client)  # also fills the prefix cache with the old weights' KV
    ref = reference_logprobs(hf_model, LONG_PROMPT, g.token_ids, temperature=0.8)
    assert (ref - torch.tensor(g.logprobs, dtype=ref.dtype)).abs().max() < 2e-3

    changed = _changed_weights(hf_model, tiny_model_dir, tmp_path / "new")
    try:
        ray.get(
            vllm_client.init_weight_sync(transport="file", master_addr=str(tmp_path / "new"), master_port=0)
        )
        (report,) = ray.get(vllm_client.receive_weights(timeout_s=30.0))  # one engine: one report
        assert report["version"] == 1 and report["num_buckets"] == 1  # one safetensors file
        assert set(report) == set(WeightSyncReport.__annotations__)
        vllm_client.close_weight_sync()
        g2 = _logprobs(vllm_client)
        ref_new = reference_logprobs(changed, LONG_PROMPT, g2.token_ids, temperature=0.8)
        assert (ref_new - torch.tensor(g2.logprobs, dtype=ref_new.dtype)).abs().max() < 2e-3
        ref_old = reference_logprobs(hf_model, LONG_PROMPT, g2.token_ids, temperature=0.8)
        assert (ref_old - torch.tensor(g2.logprobs, dtype=ref_old.dtype)).abs().max() > 1e-2
    finally:  # the engine is shared by the session: put the original weights back
        ray.get(engine.reload_weights_from_path.remote(path=str(tiny_model_dir)))
    g3 = _logprobs(vllm_client)
    assert g3.token_ids == g.token_ids
    torch.testing.assert_close(torch.tensor(g3.logprobs), torch.tensor(g.logprobs), atol=1e-4, rtol=0)


def _changed_weights(hf_model, tiny_model_dir, folder):
    changed = type(hf_model).from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in changed.named_parameters():
            if "layers.0." in name and p.dim() == 2:
                p.mul_(1.5)
    changed.save_pretrained(folder, safe_serialization=True)
    return changed


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (GPU engines shard over Ray workers)")
def test_a_cpu_engine_sharded_over_two_workers_samples_and_takes_new_weights_as_one_model(
    ray_cluster, hf_model, tiny_model_dir, tmp_path
):
    """vLLM-CPU has no Ray executor: a tensor-parallel engine runs its workers as its actor's child
    processes ("mp"), each bound to its own cores; a weight sync reaches both shards."""
    import os

    from conftest import TESTS_DIR
    from rlhf_rollout import EngineClient, create_engines

    (engine,) = create_engines(
        num_engines=1,
        backend="vllm",
        tensor_parallel_size=2,
        engine_kwargs=dict(
            model=str(tiny_model_dir),
            dtype="float32",
            max_model_len=256,
            seed=0,
            worker_extension_cls="_file_weight_ext.FileWeightExtension",
            engine_kwargs={"enforce_eager": True},
        ),
        num_cpus_per_engine=0.5,
        env_vars={
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
        },
        start_timeout_s=300,
    )
    client = EngineClient([engine], tensor_parallel_size=2, timeout_s=120)
    try:
        g = _logprobs(client)
        ref = reference_logprobs(hf_model, LONG_PROMPT, g.token_ids, temperature=0.8)
        assert (ref - torch.tensor(g.logprobs, dtype=ref.dtype)).abs().max() < 2e-3
        changed = _changed_weights(hf_model, tiny_model_dir, tmp_path / "new")
        ray.get(client.init_weight_sync(transport="file", master_addr=str(tmp_path / "new"), master_port=0))
        (report,) = ray.get(client.receive_weights(timeout_s=60.0))  # the two workers' reports, merged
        assert report["version"] == 1
        g2 = _logprobs(client)
        ref_new = reference_logprobs(changed, LONG_PROMPT, g2.token_ids, temperature=0.8)
        assert (ref_new - torch.tensor(g2.logprobs, dtype=ref_new.dtype)).abs().max() < 2e-3
    finally:
        try:
            ray.get(engine.shutdown.remote(), timeout=60)
        finally:
            ray.kill(engine, no_restart=True)


def test_a_call_seeded_engine_sends_no_request_seeds_and_refuses_a_worker_elsewhere():
    """``seed_per_sample=False``: the requests carry no seeds (the engine seeds its sampler for the call);
    an engine whose worker runs in another process says it cannot, before vLLM is asked anything."""
    from rlhf_rollout import VLLMEngine
    from rlhf_rollout.vllm_engine import vllm_sampling_params

    p = SamplingParams(n=2, seed=5, seed_per_sample=False)
    assert vllm_sampling_params(p, 3, seeded=False).seed is None
    assert vllm_sampling_params(p, 3).seed == 5 + 3 * 2  # what a V2 model runner gets: seeds per sample
    elsewhere = object.__new__(VLLMEngine)  # its start-up found the worker in another process
    elsewhere._max_model_len, elsewhere._vocab_size = 64, 100
    elsewhere._worker_here, elsewhere._v2_runner = False, False
    with pytest.raises(ValueError, match="this engine's worker runs in another process"):
        elsewhere.generate([[1, 2, 3]], p)
