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


def _critic_batch():
    from rlhf_learner import ValueBatch

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 400, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[:, :3] = False
    returns, old = torch.randn(3, 10, generator=g), torch.randn(3, 10, generator=g)
    return ValueBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids), action_mask=mask, returns=returns, old_values=old
    )


@pytest.mark.parametrize(
    "feature",
    ["critic-head", "gradient-checkpointing", "lr-schedule", pytest.param("compile", marks=pytest.mark.slow)],
)
def test_fsdp2_features_reach_deepspeeds_losses(dist_single, tiny_model_dir, feature):
    """The same steps on the same batch under both backends (one rank, fp32): a critic's value head,
    gradient checkpointing, a warmup + cosine LR schedule, and a compiled model (LoRA, packing and ring
    attention: test_distributed.py)."""
    import functools

    from rlhf_algos import aggregate_loss, sft_loss, value_loss
    from rlhf_learner import Actor, ModelOptions, SFTBatch, critic_step, load_causal_lm, load_critic, sft_step
    from rlhf_learner.strategy import LRSchedule, StrategyOptions, make_strategy

    schedule = (
        LRSchedule(kind="cosine", warmup_steps=2, total_steps=4) if feature == "lr-schedule" else LRSchedule()
    )
    options = ModelOptions(
        gradient_checkpointing=feature == "gradient-checkpointing", compile=feature == "compile"
    )
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 400, (2, 12), generator=g)
    sft = SFTBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids).bool())
    losses = {}
    for backend in ("deepspeed", "fsdp2"):
        torch.manual_seed(0)  # the critic's new value head starts alike
        strategy = make_strategy(
            StrategyOptions(backend=backend, zero_stage=0, lr=1e-2, lr_schedule=schedule)
        )
        if feature == "critic-head":
            engine = strategy.prepare(load_critic(tiny_model_dir, ds_config=strategy.loader_config()))
            vl = functools.partial(value_loss, clip_eps=None)
            agg = functools.partial(aggregate_loss, mode="token-mean")
            step = lambda: critic_step(engine, [_critic_batch()], value_loss_fn=vl, aggregate_fn=agg)  # noqa: B023, E731
        else:
            model = load_causal_lm(tiny_model_dir, options=options, ds_config=strategy.loader_config())
            engine = strategy.prepare(Actor(model, compile=options.compile))
            step = lambda: sft_step(engine, [sft], sft_loss_fn=sft_loss)  # noqa: B023, E731
        losses[backend] = [step().loss for _ in range(4)]
    assert losses["fsdp2"] == pytest.approx(losses["deepspeed"], rel=1e-5)
    assert losses["fsdp2"][-1] < losses["fsdp2"][0]


def test_a_training_backend_installed_as_a_plugin_is_found_in_any_process(tmp_path, monkeypatch):
    """A package's ``rlhf.training_backends`` entry point names the module that registers its backend: a
    name not registered yet loads it, in this process and in a fresh one (as a Ray learner worker is)."""
    import subprocess
    import sys

    from rlhf_learner.strategy import TRAINING_BACKENDS, Strategy, StrategyOptions, make_strategy

    (tmp_path / "plugged_backend.py").write_text(
        "from rlhf_learner.strategy import Strategy, register_training_backend\n\n"
        "@register_training_backend('plugged')\nclass Plugged(Strategy):\n    pass\n"
    )
    info = tmp_path / "plugged_backend-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugged-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlhf.training_backends]\nplugged = plugged_backend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        strategy = make_strategy(StrategyOptions(backend="plugged"))
        assert type(strategy).__name__ == "Plugged" and isinstance(strategy, Strategy)
    finally:
        TRAINING_BACKENDS.pop("plugged", None)
        sys.modules.pop("plugged_backend", None)
    probe = "from rlhf_learner.strategy import training_backend; print(training_backend('plugged').__name__)"
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "Plugged", out.stderr
    # a broken plugin: a name nobody registered says so, naming the plugin; the known names still work
    (info / "entry_points.txt").write_text("[rlhf.training_backends]\nbroken = no_such_module\n")
    with pytest.raises(ValueError) as err:
        StrategyOptions(backend="other")
    assert str(err.value).startswith(
        "backend: expected one of deepspeed, fsdp2, got 'other'; training backend "
    )
    assert "plugin broken (no_such_module) failed to load: No module named" in str(err.value)
    assert StrategyOptions(backend="fsdp2").backend == "fsdp2"


def test_deepspeeds_cpu_fallback_notice_is_dropped_and_its_other_warnings_kept():
    import subprocess
    import sys

    probe = (
        "import rlhf_learner.strategy, deepspeed\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "from deepspeed.utils import logger\n"
        "get_accelerator(); logger.warning('another DeepSpeed warning')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    said = out.stdout + out.stderr  # DeepSpeed's logger writes to stdout
    assert "Setting accelerator to CPU" not in said and "another DeepSpeed warning" in said
