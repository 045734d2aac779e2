"""``run_session``: however a recipe's body ends, a failed run's tracker is stopped first, then what the
run registered (last first), and a Ray the run did not start is left running."""

from __future__ import annotations

import json

import pytest
from rlhf_cli.config import SFTConfig
from rlhf_cli.recipes._session import run_session
from rlhf_cli.recipes.sft import SFT_DISPLAY
from rlhf_cli.tracking import Tracker


def _tracker(run_dir) -> Tracker:
    return Tracker(
        run_dir,
        tensorboard=True,
        wandb_project=None,
        progress=False,
        total_steps=3,
        config={},
        display=SFT_DISPLAY,
    )


def test_a_failed_run_stops_its_tracker_then_what_it_started(tmp_path, ray_cluster):
    events: list[str] = []
    with pytest.raises(RuntimeError, match="step 2 broke"), run_session(SFTConfig()) as session:
        assert session.resources.cpus > 0
        session.stop_at_exit(lambda: events.append("groups"))
        session.stop_at_exit(lambda: events.append(f"engines (tensorboard open: {tracker.tb is not None})"))
        tracker = session.tracker = _tracker(tmp_path)
        tracker.log(1, {"train/loss": 1.0})
        raise RuntimeError("step 2 broke")
    assert events == ["engines (tensorboard open: False)", "groups"]  # the tracker was stopped first
    assert not (tmp_path / "summary.txt").exists()  # a failed run draws no summary
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [1]
    assert ray_cluster.is_initialized()  # started by the test, not by the run


def test_a_finished_run_stops_what_it_started(tmp_path, ray_cluster):
    events: list[str] = []
    with run_session(SFTConfig()) as session:
        session.stop_at_exit(lambda: events.append("groups"))
        session.tracker = _tracker(tmp_path)
        session.tracker.log(1, {"train/loss": 1.0})
        session.tracker.close()
    assert events == ["groups"]
    assert (tmp_path / "summary.txt").exists() and (tmp_path / "loss_curve.png").exists()
    assert ray_cluster.is_initialized()
