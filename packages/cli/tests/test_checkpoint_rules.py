"""What a resumed run may change: the run's length, unless a learning-rate schedule spans it."""

from __future__ import annotations

from pathlib import Path

import pytest
from rlhf_cli.config import PPOConfig
from rlhf_cli.runtime.runs.checkpoint import RESUMABLE_CHANGES, check_compatible, resumable_changes


def config(**train) -> dict:
    return PPOConfig.model_validate({"train": {"warmup_sft_steps": 0, **train}}).model_dump(mode="json")


def test_the_length_may_change_without_a_schedule_only():
    saved, longer = config(num_steps=2), config(num_steps=4)
    check_compatible(saved, longer, where=Path("ckpt"), resumable=resumable_changes(lr_scheduled=False))
    with pytest.raises(ValueError, match=r"train.num_steps=2, this run has --train.num_steps 4"):
        check_compatible(saved, longer, where=Path("ckpt"), resumable=resumable_changes(lr_scheduled=True))
    assert set(resumable_changes(lr_scheduled=False, extra=("eval.path",))) == {
        *RESUMABLE_CHANGES,
        "eval.path",
    }


def test_which_settings_make_a_schedule():
    assert not PPOConfig().lr_scheduled
    assert PPOConfig.model_validate({"actor": {"lr_scheduler": "cosine"}}).lr_scheduled
    assert PPOConfig.model_validate({"actor": {"lr_warmup_steps": 3}}).lr_scheduled
    # the critic's counts only when the run has a critic
    assert not PPOConfig.model_validate({"critic": {"lr_scheduler": "linear"}}).lr_scheduled
    gae = {"algo": {"advantage": {"estimator": "gae"}}, "critic": {"lr_warmup_ratio": 0.1}}
    assert PPOConfig.model_validate(gae).lr_scheduled


def test_the_critic_schedule_leaves_out_the_demos_warmup():
    cfg = PPOConfig.model_validate({"algo": {"advantage": {"estimator": "gae"}}, "train": {"num_steps": 10}})
    assert cfg.warmup_runs
    assert cfg.total_optimizer_steps("actor") == 10 + cfg.train.warmup_sft_steps
    assert cfg.total_optimizer_steps("critic") == 10


def test_a_checkpoint_older_than_a_setting_stays_resumable():
    saved, now = config(), config()
    del saved["data"]["strict"]  # written before --data.strict existed
    check_compatible(saved, now, where=Path("ckpt"))
    saved["data"]["path"] = "other.jsonl"  # a setting both know still has to match
    with pytest.raises(ValueError, match=r"data.path='other.jsonl'"):
        check_compatible(saved, now, where=Path("ckpt"))


def test_a_group_resumes_at_the_zero_stage_its_checkpoint_was_written_with(tmp_path):
    """One rank runs ZeRO-1/2 as stage 0, unless the checkpoint it resumes holds that group's ZeRO
    partitions (written at ZeRO-2 by an older version) or its states are offloaded between phases."""
    from rlhf_cli.runtime.learners.specs import group_strategy
    from rlhf_cli.runtime.runs.checkpoint import zero_partitioned
    from rlhf_learner import StrategyOptions

    (tmp_path / "actor" / "state").mkdir(parents=True)
    (tmp_path / "critic" / "state").mkdir(parents=True)
    (tmp_path / "actor" / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (tmp_path / "critic" / "state" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert zero_partitioned(tmp_path, "actor") and not zero_partitioned(tmp_path, "critic")
    assert not zero_partitioned(None, "actor")

    def stage(world: int, **kw) -> int:
        ds = StrategyOptions(zero_stage=2)
        common = dict(lr=1e-3, micro_batch_size=4, grad_accum_steps=1, seed=0, world_size=world)
        return group_strategy(ds, **common, **kw).zero_stage

    assert stage(1, frozen=False) == 0 and stage(2, frozen=False) == 2 and stage(1, frozen=True) == 0
    assert stage(1, frozen=False, keep_stage=True) == 2


def test_the_demo_trains_one_micro_batch_per_rank_unless_told():
    """The built-in demo (no model, data or reward) sets no micro-batch size of its own when one is given,
    and its default fits every trained group's shard (here a critic on two ranks beside one actor rank)."""
    from rlhf_cli.config import build_config
    from rlhf_cli.config.run import TrainConfig

    assert build_config(PPOConfig, []).train.micro_batch_size == 128  # 16 prompts x 8 samples, one rank
    gae = build_config(PPOConfig, ["--algo.advantage.estimator", "gae", "--critic.num_devices_per_node", "2"])
    assert gae.train.micro_batch_size == 64 and gae.grad_accum_steps == 2
    assert build_config(PPOConfig, ["--train.micro_batch_size", "16"]).train.micro_batch_size == 16
    given = TrainConfig()
    assert PPOConfig(train=given).train.micro_batch_size == 128 and given.micro_batch_size == 16
    model = PPOConfig.model_validate({"actor": {"pretrain": "some/model"}})
    assert model.train.micro_batch_size == 16  # not the demo: the documented default


def test_a_restart_resumes_from_the_latest_checkpoint_or_starts_again_from_step_0(tmp_path):
    from rlhf_cli.config import SFTConfig, build_config
    from rlhf_cli.runtime.runs.restarts import restarted

    cfg = build_config(SFTConfig, ["--logger.run_dir", str(tmp_path / "run")])
    assert cfg.train.max_restarts == 3
    again, where = restarted(cfg)
    assert where == "from step 0 (no checkpoint yet)"
    assert again.logger.overwrite and not again.ckpt.load_enable  # the earlier attempt's outputs go
