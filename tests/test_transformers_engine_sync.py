"""rlhf-weightsync into rlhf-rollout's TransformersEngine through its worker extension, as rlhf ppo does
with the transformers backend: the engine then samples with the sender's weights."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
from rlhf_learner.strategy import free_port
from rlhf_rollout import SamplingParams, TransformersEngine
from rlhf_weightsync import SyncStats, WeightSender, WeightSyncError

EXT = "rlhf_weightsync.module_ext.ModuleWeightSyncExtension"


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_transformers_engine_receives_a_sync_and_samples_with_it(tiny_model_dir, transport):
    from transformers import AutoModelForCausalLM

    engine = TransformersEngine(model=tiny_model_dir, worker_extension_cls=EXT)
    assert engine.capabilities.weight_sync_extension
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))
    port = free_port()
    joined = threading.Thread(
        target=engine.init_weight_sync,
        kwargs=dict(
            transport=transport, master_addr="127.0.0.1", master_port=port, rank_offset=1, world_size=2
        ),
    )
    joined.start()
    reports: list = []
    with WeightSender(transport=transport, master_addr="127.0.0.1", master_port=port, world_size=2) as sender:
        joined.join(timeout=60)
        t = threading.Thread(target=lambda: reports.append(engine.receive_weights(timeout_s=60)))
        t.start()
        stats = sender.send(trained.named_parameters())
        t.join(timeout=60)
    engine.close_weight_sync()
    assert reports and SyncStats.from_report(reports[0]) == replace(stats, seconds=reports[0]["seconds"])
    assert reports[0]["version"] == stats.version == 1
    for name, p in trained.state_dict().items():
        torch.testing.assert_close(engine.model.state_dict()[name], p, atol=0, rtol=0)

    prompt = [[5, 17, 42, 99]]
    gen = engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=6, seed=1))[0][0]
    ids = torch.tensor([prompt[0] + gen.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(trained(ids).logits[0, :-1].float(), -1)
    ref = logp[torch.arange(3, ids.shape[1] - 1), ids[0, 4:]]
    torch.testing.assert_close(torch.tensor(gen.logprobs), ref, atol=1e-4, rtol=0)


def test_a_sync_missing_a_tensor_fails_on_both_sides(tiny_model_dir):
    engine = TransformersEngine(model=tiny_model_dir, worker_extension_cls=EXT)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    port = free_port()
    joined = threading.Thread(
        target=engine.init_weight_sync,
        kwargs=dict(transport="gloo", master_addr="127.0.0.1", master_port=port, rank_offset=1, world_size=2),
    )
    joined.start()
    errors: list = []

    def receive():
        try:
            engine.receive_weights(timeout_s=60)
        except Exception as err:
            errors.append(err)

    with WeightSender(transport="gloo", master_addr="127.0.0.1", master_port=port, world_size=2) as sender:
        joined.join(timeout=60)
        t = threading.Thread(target=receive)
        t.start()
        with pytest.raises(WeightSyncError, match="did not contain"):
            sender.send([("model.norm.weight", torch.ones(128))])
        t.join(timeout=60)
    engine.close_weight_sync()
    assert errors and "did not contain" in str(errors[0])
    assert set(before) == set(engine.model.state_dict())
