"""What a resumed run may change: the run's length, unless a learning-rate schedule spans it."""

from __future__ import annotations

from pathlib import Path

import pytest
from rlhf_cli.config import PPOConfig
from rlhf_cli.runtime.checkpoint import RESUMABLE_CHANGES, check_compatible, resumable_changes


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
