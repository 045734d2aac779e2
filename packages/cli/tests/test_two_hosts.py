"""Two real hosts on this machine (``two_host_ray``: network namespaces on a veth link, 10.213.0.1 and
10.213.0.2): a Ray cluster with its head on host A and a worker node on host B, Ray's token
authentication on; the drivers run in host A, and the run folder is on the filesystem both hosts share.

- ``rlhf sft --model.num_nodes 2 --train.elastic`` (fsdp2): a rank on each host, gloo all-reduces across
  the link; the same losses as two ranks on one host. Then host B is lost mid-run, and the same driver goes
  on on host A at data-parallel size 1 to the last step. Host B is then brought back.
- ``rlhf ppo --actor.num_nodes 2``: a ZeRO-3 rank on each host, the engine on host B, the weights synced
  over gloo across the link (what ``--weightsync.transport auto`` resolves to, as the run logs), the
  engine's log-probs equal to the learner's after every sync. Killed with SIGKILL at the driver at a
  random step, and resumed: it ends with the uninterrupted run's weights and metrics (checkpoints written
  from both hosts into one run folder).
- Host B lost mid-run (its link goes dark, every process in it dies) under ``rlhf ppo`` without
  ``--train.elastic``: one line names the host and the rank and engine that were on it, the restart finds
  the actor's two nodes missing and ends the run in one line, and nothing is left running on host A.
  Runs last: host B stays down.

The kill steps are drawn at random (``RLHF_KILL_SEED`` is printed).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from rlhf_cli.config import SFTConfig, build_config
from rlhf_cli.demo import task
from rlhf_cli.offline import sft
from rlhf_testkit.commands import (
    Driver,
    kill_steps_rng,
    ray_workers,
    rows,
    same_weights,
    training_metrics,
)
from rlhf_testkit.hosts import RayCluster

pytestmark = pytest.mark.slow

QUIET = ["--logger.progress", "false", "--logger.tensorboard", "false"]
ACROSS = ["--ray.cpus_per_worker", "1"]  # host A (1 CPU) holds one rank; host B (2) a rank and the engine


@pytest.fixture(scope="module")
def rng():
    return kill_steps_rng()


def on_both_hosts(d: Driver, cluster: RayCluster, kind: str, only: int | None = None) -> None:
    """Wait until this run has a ``ray::<kind>`` process in each host (in host ``only`` alone, if given)."""
    hosts = cluster.hosts if only is None else (cluster.hosts[only],)
    seen = lambda: all(ray_workers(kind, d.started_since_boot, h) for h in hosts)  # noqa: E731
    d.wait_for(seen, f"{kind} on {len(hosts)} host(s)", poll=0.2)
    if only is not None:
        others = [h for i, h in enumerate(cluster.hosts) if i != only]
        assert not any(ray_workers(kind, d.started_since_boot, h) for h in others), (
            f"a {kind} outside host {only}"
        )


def test_sft_across_hosts_gives_one_hosts_losses_and_goes_on_elastic_on_the_host_left(
    two_host_ray, ray_cluster, demo_model_dir, tmp_path, shared_processes
):
    """``rlhf sft --train.elastic`` on two fsdp2 ranks, one on each host, checkpointed every step: its steps
    give the losses of the same run on one host; then host B is lost after step 2, and the same driver goes
    on on host A alone, at data-parallel size 1 (the batch kept by twice the accumulation), from the
    checkpoint both ranks wrote, to the last step. Host B is brought back for the tests after this one."""
    cluster = two_host_ray
    a, b = cluster.hosts
    wrong = cluster.status(env={**cluster.env, "RAY_AUTH_TOKEN": "not-the-token"})
    assert wrong.returncode != 0 and "auth" in (wrong.stdout + wrong.stderr).lower()  # the token is checked

    data = task.write_data("sft", tmp_path / "sft.jsonl", seed=0)
    flags = [
        *("--model.pretrain", str(demo_model_dir), "--data.path", str(data), "--data.apply_chat_template"),
        *("--train.batch_size", "12", "--train.micro_batch_size", "6", "--train.num_steps", "5"),
        *(
            "--learner.backend",
            "fsdp2",
            "--model.lr",
            "1e-3",
            "--eval.every",
            "0",
            "--train.seed",
            "3",
            *QUIET,
        ),
    ]
    one_host = ["--model.num_devices_per_node", "2", "--logger.run_dir", str(tmp_path / "one")]
    sft.run(build_config(SFTConfig, [*flags, *one_host]))  # the session's local cluster: one host

    elastic = [
        "--model.num_nodes",
        "2",
        "--ckpt.save_steps",
        "1",
        "--train.elastic",
        "--train.max_restarts",
        "1",
    ]
    run_dir = tmp_path / "run"
    d = Driver("sft", [*flags, *elastic, *ACROSS], cluster.address, run_dir, env=cluster.env, host=a)
    try:
        on_both_hosts(d, cluster, "LearnerWorker")
        d.wait_steps(2)
        b.power_off()
        rc, _, err = d.finish(timeout=300)
    finally:
        with shared_processes():  # the cluster's node, stopped with it
            cluster.power_on(b, num_cpus=2)
    assert rc == 0, err[-3000:]
    assert f"host {b.ip} was lost (Ray node " in err and "; restart 1 of 1, resuming from " in err, err[
        -3000:
    ]
    shrunk = "--train.elastic: 1 node(s) left: --model.num_nodes 2 -> 1 (2 -> 1 ranks, data-parallel 2 -> 1)"
    assert shrunk in err, err[-3000:]
    one, logged = rows(tmp_path / "one"), rows(run_dir)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5] and all(r["train/loss"] > 0 for r in logged)
    for x, y in zip(one[:2], logged[:2], strict=True):  # both hosts' steps: one host's losses
        assert y["train/loss"] == pytest.approx(x["train/loss"], rel=1e-5), x["step"]
    went_on_with = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert went_on_with["model"]["num_nodes"] == 1 and went_on_with["train"]["elastic"]


PPO_STEPS = 6


@pytest.fixture(scope="module")
def ppo_flags(demo_model_dir) -> list[str]:
    """The built-in task on the demo model, REINFORCE++ (no critic, no reference), the actor's two ZeRO-3
    ranks on two hosts, the transformers engine (what dies is an engine process either way), a checkpoint
    every 2 steps."""
    return [
        *("--actor.pretrain", str(demo_model_dir), "--rollout.backend", "transformers"),
        *("--algo.advantage.estimator", "reinforce", "--algo.kl.coef", "0"),
        *("--actor.num_nodes", "2", "--learner.zero_stage", "3"),
        *("--train.num_steps", str(PPO_STEPS), "--rollout.batch_size", "4"),
        *("--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "6"),
        *("--train.micro_batch_size", "4", "--eval.every", "0", "--ckpt.save_steps", "2", *ACROSS, *QUIET),
        *("--train.max_restarts", "0"),  # what a death does without restarts (restarts: test_kill_resume.py)
    ]


def test_ppo_across_hosts_killed_at_the_driver_ends_as_an_uninterrupted_run(
    rng, two_host_ray, ppo_flags, tmp_path
):
    cluster = two_host_ray

    def driver(flags: list[str], run_dir: Path) -> Driver:
        return Driver("ppo", flags, cluster.address, run_dir, env=cluster.env, host=cluster.hosts[0])

    d = driver(ppo_flags, tmp_path / "whole")
    on_both_hosts(d, cluster, "LearnerWorker")
    on_both_hosts(d, cluster, "EngineActor", only=1)
    rc, _, err = d.finish()
    assert rc == 0, err[-3000:]
    assert f"weight sync: actor rank 0 on {cluster.hosts[0].ip} -> 1 engine process(es) over gloo" in err
    whole = rows(tmp_path / "whole")  # the engine held the learner's weights after every sync
    assert [r["sync/weight_version"] for r in whole] == list(range(2, PPO_STEPS + 2))
    assert max(r["sync/logp_mismatch_max"] for r in whole) < 1e-3

    run_dir = tmp_path / "killed"
    d = driver(ppo_flags, run_dir)  # 1. the driver, at a random step
    d.wait_steps(rng.randint(3, 5))
    d.kill()

    rc, _, err = driver([*ppo_flags, "--ckpt.load_enable"], run_dir).finish()  # 2. resumed, to the end
    assert rc == 0, err[-3000:]
    assert training_metrics(run_dir) == training_metrics(tmp_path / "whole")
    same_weights(run_dir / "final_model", tmp_path / "whole" / "final_model")


def test_losing_a_host_ends_the_run_naming_the_host_and_what_ran_there(two_host_ray, ppo_flags, tmp_path):
    """Host B lost mid-run, one restart allowed but no --train.elastic: the restart finds one node where
    the actor spans two, and the run ends naming what is missing, after a line naming the host and the
    rank and engine that were on it. The rank on host A is stopped with the run."""
    cluster = two_host_ray
    a, b = cluster.hosts
    flags = [*ppo_flags, "--train.max_restarts", "1"]
    d = Driver("ppo", flags, cluster.address, tmp_path / "run", env=cluster.env, host=a)
    d.wait_steps(3)  # after the checkpoint of step 2
    lost_at = time.monotonic()
    b.power_off()
    rc, _, err = d.finish(timeout=120)
    assert rc == 2 and time.monotonic() - lost_at < 90, err[
        -3000:
    ]  # 2: what the run was given no longer fits
    lines = err.strip().splitlines()
    lost = [line for line in lines if line.startswith(f"host {b.ip} was lost (Ray node ")]
    assert len(lost) == 1, err[-3000:]
    assert "; on it: the actor group's rank 1, rollout engine 0; restart 1 of 1, resuming from " in lost[0]
    assert lines[-1].startswith("error: --actor.num_nodes 2: the group spans 2 nodes, the cluster has 1 ("), (
        lines
    )
    assert "--train.elastic" in lines[-1]
    deadline = time.monotonic() + 30  # the rank on host A was stopped with the run
    while ray_workers("LearnerWorker", d.started_since_boot, a):
        assert time.monotonic() < deadline, "the run left its rank running on host A"
        time.sleep(0.5)
