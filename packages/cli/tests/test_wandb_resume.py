"""W&B resume: the run's id is kept in the checkpoint, and a resumed run continues that W&B run (W&B in
offline mode: nothing leaves the machine)."""

from __future__ import annotations

import pytest
from rlhf_cli.data.prompts import PromptCursor
from rlhf_cli.runtime.runs.checkpoint import RunState, latest_checkpoint, load_checkpoint, save_checkpoint
from rlhf_cli.runtime.runs.tracking import Tracker


def tracker(run_dir, **kw) -> Tracker:
    return Tracker(
        run_dir, tensorboard=False, wandb_project="rlhf-test", progress=False, total_steps=4, config={}, **kw
    )


@pytest.fixture
def wandb_service():
    """W&B's service process (``wandb-core``, started by the first ``wandb.init``) stopped afterwards, and
    no settings left from an earlier test in this process (read once, at W&B's set-up)."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch, wandb_service):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = tracker(tmp_path)
    first.log(1, {"train/loss": 1.0})
    run_id = first.wandb_run_id
    assert run_id
    state = RunState(step=1, cursor=PromptCursor(), wandb_run_id=run_id)
    save_checkpoint(tmp_path / "checkpoints", state, {}, max_keep=2, config={})
    first.stop(failed=True)  # the first run dies after its checkpoint

    resumed = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"), {})
    assert resumed.wandb_run_id == run_id
    second = tracker(tmp_path, wandb_id=resumed.wandb_run_id, resume_step=resumed.step)
    assert second.wandb.id == run_id
    second.log(2, {"train/loss": 0.5})
    second.stop()
    # both sessions wrote to the run with that id (two starts in one second: W&B suffixes the second folder)
    runs = list((tmp_path / "wandb").glob(f"offline-run-*/run-{run_id}.wandb"))
    assert len(runs) == 2


def test_without_wandb_no_id_is_kept(tmp_path):
    t = Tracker(tmp_path, tensorboard=False, wandb_project=None, progress=False, total_steps=1, config={})
    assert t.wandb_run_id is None
    t.stop()
