"""StrategyOptions validation and the DeepSpeed config it builds."""

from __future__ import annotations

import pytest
from rlhf_learner.strategy import StrategyOptions, build_ds_config


def test_config_carries_every_option():
    opts = StrategyOptions(
        zero_stage=3,
        offload_optimizer=True,
        offload_params=True,
        precision="bf16",
        micro_batch_size=2,
        grad_accum_steps=4,
        grad_clip=0.5,
        lr=3e-4,
        weight_decay=0.1,
    )
    cfg = build_ds_config(opts)
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert cfg["bf16"] == {"enabled": True}
    assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["optimizer"]["type"] == "AdamW"
    assert cfg["optimizer"]["params"]["torch_adam"] is True
    assert cfg["optimizer"]["params"]["fused"] is True  # torch's one-kernel AdamW
    assert cfg["optimizer"]["params"]["lr"] == 3e-4 and cfg["optimizer"]["params"]["weight_decay"] == 0.1


def test_inference_config_has_no_optimizer_and_no_clipping():
    cfg = build_ds_config(StrategyOptions(zero_stage=3, offload_params=True), train=False)
    assert "optimizer" not in cfg and "gradient_clipping" not in cfg
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_no_clipping_and_autotp_and_muon_configs():
    assert build_ds_config(StrategyOptions(grad_clip=None))["gradient_clipping"] == 0.0
    assert build_ds_config(StrategyOptions(tensor_parallel_size=2))["tensor_parallel"] == {"autotp_size": 2}
    assert build_ds_config(StrategyOptions(optimizer="muon"))["optimizer"]["type"] == "Muon"


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"zero_stage": 4}, "zero_stage"),
        ({"zero_stage": 2, "offload_params": True}, "offload_params"),
        ({"zero_stage": 0, "offload_optimizer": True}, "offload_optimizer"),
        ({"precision": "fp16"}, "precision"),
        ({"optimizer": "sgd"}, "optimizer"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"grad_accum_steps": -1}, "grad_accum_steps"),
        ({"grad_clip": 0.0}, "grad_clip"),
        ({"lr": 0.0}, "lr"),
        ({"zero_stage": 3, "tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"sequence_parallel_size": 0}, "sequence_parallel_size"),
    ],
)
def test_bad_options_name_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        StrategyOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "stage"),
    [
        ({"zero_stage": 0}, 0),
        ({"zero_stage": 1, "offload_optimizer": True}, 0),
        ({"zero_stage": 2, "offload_optimizer": True}, 0),
        ({"zero_stage": 3, "offload_optimizer": True, "offload_params": True}, 3),
    ],
)
def test_for_inference_runs_zero_1_2_as_replicas_and_keeps_zero3_sharding(kwargs, stage):
    opts = StrategyOptions(precision="bf16", sequence_parallel_size=2, seed=7, lr=3e-4, **kwargs)
    frozen = opts.for_inference()
    assert frozen.zero_stage == stage and frozen.offload_optimizer is False
    assert frozen.offload_params == opts.offload_params
    assert (frozen.precision, frozen.sequence_parallel_size, frozen.seed, frozen.lr) == ("bf16", 2, 7, 3e-4)
    assert opts.zero_stage == kwargs["zero_stage"]  # a copy: the trained model's options are unchanged
    cfg = build_ds_config(frozen, train=False)
    assert cfg["zero_optimization"]["stage"] == stage and "offload_optimizer" not in cfg["zero_optimization"]


def test_offload_states_says_why_it_did_nothing():
    import torch
    from rlhf_learner.strategy import offload_states, reload_states

    why = "a frozen group has no optimizer states" if torch.cuda.is_available() else "on CPU the states are"
    assert offload_states(object()).startswith(f"skipped: {why}")  # no engine with states to move
    assert reload_states(object()).startswith(f"skipped: {why}")
