"""The fsdp2 training backend in one process: mixed precision, CPU offload, what it refuses; and the
training-backend registry. Its multi-rank checks, beside DeepSpeed's, are in test_distributed.py."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize(
    "opts",
    [
        {"precision": "bf16"},
        {"zero_stage": 3, "offload_params": True},
        {"zero_stage": 3, "precision": "bf16"},
    ],
    ids=["bf16-mixed", "cpu-offload", "full-shard-bf16"],
)
def test_fsdp2_mixed_precision_and_offload_train(dist_single, tiny_model_dir, opts):
    from rlhf_algos import sft_loss
    from rlhf_learner import Actor, SFTBatch, load_causal_lm, sft_step
    from rlhf_learner.strategy import FSDP2Strategy, StrategyOptions

    strategy = FSDP2Strategy(StrategyOptions(backend="fsdp2", lr=1e-2, **opts))
    engine = strategy.prepare(Actor(load_causal_lm(tiny_model_dir)))
    master = next(engine.module.parameters())
    assert master.dtype == torch.float32  # sharded fp32 parameters; bf16 only in compute
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 400, (2, 12), generator=g)
    mb = SFTBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids).bool())
    losses = [sft_step(engine, [mb], sft_loss_fn=sft_loss).loss for _ in range(4)]
    assert losses[-1] < losses[0] - 0.2
    stats = strategy.memory_stats()
    assert stats["rss"] > 0.1


def test_fsdp2_refuses_what_only_deepspeed_has(dist_single, tiny_model_dir):
    from rlhf_learner import Actor, load_causal_lm
    from rlhf_learner.strategy import FSDP2Strategy, StrategyOptions

    with pytest.raises(ValueError, match=r"^tensor_parallel_size: .*deepspeed backend only"):
        StrategyOptions(backend="fsdp2", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^optimizer: muon is in the deepspeed backend only"):
        StrategyOptions(backend="fsdp2", optimizer="muon")
    with pytest.raises(ValueError, match=r"^offload_optimizer: fsdp2 offloads .* set offload_params"):
        StrategyOptions(backend="fsdp2", zero_stage=2, offload_optimizer=True)
    model = Actor(load_causal_lm(tiny_model_dir))
    built = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="a factory of the parameters"):
        FSDP2Strategy(StrategyOptions(backend="fsdp2")).prepare(model, optimizer=built)


def test_the_registry_names_its_backends_and_refuses_a_second_under_one_name():
    from rlhf_learner.strategy import (
        TRAINING_BACKENDS,
        FSDP2Strategy,
        Strategy,
        StrategyOptions,
        TrainingBackend,
        make_strategy,
        register_training_backend,
    )

    assert {"deepspeed": Strategy, "fsdp2": FSDP2Strategy} == TRAINING_BACKENDS
    assert isinstance(make_strategy(StrategyOptions(backend="fsdp2")), FSDP2Strategy)
    assert isinstance(make_strategy(StrategyOptions()), TrainingBackend)
    with pytest.raises(ValueError, match=r"^backend: expected one of deepspeed, fsdp2, got 'megatron'"):
        StrategyOptions(backend="megatron")
    with pytest.raises(ValueError, match="registered already"):
        register_training_backend("fsdp2")(type("Other", (), {}))
    assert TRAINING_BACKENDS["fsdp2"] is FSDP2Strategy
