"""``run_session``: however a recipe's body ends, a failed run's tracker is stopped first, then what the
run registered (last first, each even if another fails), then Ray if the run started it; a Ray the run
did not start is left running."""

from __future__ import annotations

import json

import pytest
from rlhf_cli.config import SFTConfig
from rlhf_cli.offline.sft import SFT_DISPLAY
from rlhf_cli.runtime.plan.cluster import ClusterResources
from rlhf_cli.runtime.runs import session as _session
from rlhf_cli.runtime.runs.session import run_session
from rlhf_cli.runtime.runs.tracking import Tracker


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


class _FailingTracker:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def stop(self, *, failed: bool = False) -> None:
        self.events.append(f"tracker failed={failed}")
        raise OSError("disk full")


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_every_exit_runs_even_when_one_fails_and_ray_stops_last(monkeypatch, error):
    """The run started Ray: it is shut down after the stops, even though the tracker and a stop fail;
    the body's own error is what comes out (Ctrl-C included)."""
    import ray

    events: list[str] = []
    resources = ClusterResources(cpus=2, gpus=0, nodes=1)
    monkeypatch.setattr(_session, "start_ray", lambda cfg: (resources, True))
    monkeypatch.setattr(ray, "shutdown", lambda: events.append("ray.shutdown"))

    def failing_stop():
        events.append("engines")
        raise RuntimeError("engine already gone")

    with pytest.raises(error, match="the body"), run_session(SFTConfig()) as session:
        session.stop_at_exit(lambda: events.append("groups"))
        session.stop_at_exit(failing_stop)
        session.tracker = _FailingTracker(events)
        raise error("the body")
    assert events == ["tracker failed=True", "engines", "groups", "ray.shutdown"]


def test_a_stop_failing_after_a_good_run_is_raised_after_the_other_exits(monkeypatch):
    import ray

    events: list[str] = []
    monkeypatch.setattr(_session, "start_ray", lambda cfg: (ClusterResources(cpus=2, gpus=0, nodes=1), True))
    monkeypatch.setattr(ray, "shutdown", lambda: events.append("ray.shutdown"))

    def failing_stop():
        raise RuntimeError("engine already gone")

    with pytest.raises(RuntimeError, match="engine already gone"), run_session(SFTConfig()) as session:
        session.stop_at_exit(lambda: events.append("groups"))
        session.stop_at_exit(failing_stop)
    assert events == ["groups", "ray.shutdown"]


def test_a_short_runs_curve_has_whole_step_ticks(tmp_path):
    tracker = _tracker(tmp_path)
    key = next(iter(SFT_DISPLAY.curves))
    tracker.history = [{"step": s, key: 1.0 / s} for s in (1, 2, 3)]
    ticks = [t for t in tracker.curve_figure().axes[0].get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert tracker.plot().is_file()


def test_ctrl_c_says_after_which_step_and_how_to_resume(monkeypatch, tmp_path, capsys):
    import ray
    from rlhf_cli.config import build_config

    monkeypatch.setattr(_session, "start_ray", lambda cfg: (ClusterResources(cpus=2, gpus=0, nodes=1), True))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    cfg = build_config(SFTConfig, ["--logger.run_dir", str(tmp_path)])
    step = tmp_path / "checkpoints" / "step_000006"
    step.mkdir(parents=True)
    (step / "run_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest").write_text(step.name)
    with pytest.raises(KeyboardInterrupt), run_session(cfg) as session:
        session.tracker = _tracker(tmp_path)
        for s in (5, 6, 7):
            session.tracker.log(s, {"train/loss": 1.0})
        raise KeyboardInterrupt
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"interrupted after step 7; rerun with --ckpt.load_enable to resume from {step}"
    )


def test_progress_off_a_terminal_is_a_plain_line_per_step_and_best_has_a_direction(tmp_path, capsys):
    from rlhf_cli.runtime.runs.tracking import PPO_DISPLAY

    tracker = Tracker(
        tmp_path, tensorboard=False, wandb_project=None, progress=True, total_steps=3, config={}
    )
    assert tracker.display is PPO_DISPLAY
    for step, (reward, kl, loss) in enumerate([(0.1, 0.01, 0.9), (0.6, 0.05, 0.4), (0.4, 0.03, 0.7)], 1):
        tracker.log(
            step, {"rollout/reward_mean": reward, "policy/kl": kl, "actor/loss": loss, "time/step": 2.0}
        )
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ppo step")]
    assert [line.split()[2] for line in lines] == ["1/3", "2/3", "3/3"]
    assert "reward 0.600" in lines[1] and lines[1].endswith("s]")
    cells = [[c.strip() for c in line.split("│") if c.strip()] for line in tracker.close().splitlines()]
    rows = {c[0]: c[1:] for c in cells if len(c) == 4}
    assert rows["rollout/reward_mean"][-1] == "0.6000"  # higher is better
    assert rows["actor/loss"][-1] == "0.4000"  # lower is better
    assert rows["policy/kl"][-1] == "-"  # neither: no best
