"""Kill and resume, as users run the commands: ``rlhf sft`` and ``rlhf ppo`` in subprocesses joined with
``--ray.address`` to a Ray cluster (the session's for sft; for ppo, a cluster of two nodes started with
``ray start``, Ray's token authentication on), killed with SIGKILL at random steps:

- the driver, mid-run;
- the driver and the learner rank while a checkpoint is being written;
- a learner rank's process (the run ends within a minute, in one line naming the rank);
- a rollout engine's process, mid-generation and again mid-weight-sync (likewise, naming the engine).

Every resume (``--ckpt.load_enable``) continues from the newest complete checkpoint (the half-written one
is left alone), and the last one ends with the final weights and the logged metrics of an uninterrupted
run with the same seed: every step once, the same data position at each. One resume starts exactly at an
epoch boundary. A run resumed at its last step says it is finished and starts nothing; a checkpoint
whose data state is damaged is refused, naming the file. The kill steps are drawn at random (the seed is
printed)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from rlhf_cli.config import SFTConfig, build_config
from rlhf_cli.demo import task
from rlhf_cli.offline import sft
from rlhf_cli.runtime.checkpoint import RunFinished
from rlhf_testkit import free_port
from safetensors.torch import load_file

BIN = Path(sys.executable).parent
SEED = int(os.environ.get("RLHF_KILL_SEED", time.time_ns() % 10_000))
QUIET = ["--logger.progress", "false", "--logger.tensorboard", "false"]


@pytest.fixture(scope="module")
def rng():
    print(f"kill steps drawn with RLHF_KILL_SEED={SEED}")
    return random.Random(SEED)


@pytest.fixture(scope="module")
def address(ray_cluster) -> str:
    return ray_cluster.get_runtime_context().gcs_address


# `ray start` switches Ray's token authentication on; its clients (ray status, the rlhf driver) need the
# same mode to read the token file Ray keeps. A cluster of several nodes needs
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 (0 refuses a second node).
CLUSTER_ENV = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}


def _ray_start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", *args],
        env=CLUSTER_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _ray_stop(proc: subprocess.Popen, *, graceful: bool) -> None:
    """SIGTERM (a worker node leaves in a second), or SIGKILL to the node's whole process group (a head
    takes over 30 s to stop on SIGTERM; every process it started is in its group, and the leftover check
    would name any that escaped)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM if graceful else signal.SIGKILL)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def ray_start_cluster(tmp_path_factory):
    """A head and a second node started with ``ray start`` on 127.0.0.1 (one CPU each); its address."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    nodes = [
        _ray_start(
            "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={temp}"
        )
    ]
    try:
        status = [str(BIN / "ray"), "status", f"--address={address}"]
        deadline = time.monotonic() + 120
        while subprocess.run(status, env=CLUSTER_ENV, capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, "ray head did not come up"
            time.sleep(1)
        nodes.append(_ray_start(f"--address={address}", "--num-cpus=1"))
        while (
            subprocess.run(status, env=CLUSTER_ENV, capture_output=True, text=True).stdout.count("node_") < 2
        ):
            assert time.monotonic() < deadline, "the second ray node did not join"
            time.sleep(1)
        yield address
    finally:
        for p in reversed(nodes):  # the worker node first, then the head
            _ray_stop(p, graceful=p is not nodes[0])
        shutil.rmtree(temp, ignore_errors=True)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # (one being written: not yet)


def training_metrics(run_dir: Path) -> list[dict]:
    """Every logged row without its timings (which differ from run to run)."""
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows(run_dir)]


def ray_workers(kind: str, since: float) -> list[psutil.Process]:
    """The session cluster's ``ray::<kind>`` processes started after ``since`` (this run's)."""
    found = []
    for p in psutil.process_iter(["name", "cmdline", "create_time"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if cmd.startswith(f"ray::{kind}") and p.info["create_time"] >= since - 1:
            found.append(p)
    return found


class Driver:
    """``rlhf <command> <flags> --ray.address <address>`` in a subprocess of its own session."""

    def __init__(
        self, command: str, flags: list[str], address: str, run_dir: Path, *, env: dict | None = None
    ) -> None:
        self.run_dir = run_dir
        self.started = time.time()
        self.proc = subprocess.Popen(
            [str(BIN / "rlhf"), command, *flags, "--ray.address", address, "--logger.run_dir", str(run_dir)],
            env={**(env or os.environ), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def wait_for(self, done, what: str, timeout: float = 240.0, poll: float = 0.002) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended before {what}: {self.proc.stderr.read()[-3000:]}")
            assert time.monotonic() < deadline, f"no {what} within {timeout} s"
            time.sleep(poll)

    def wait_steps(self, n: int) -> None:
        """Until this run has logged step ``n`` (a resumed run first rewrites the log up to its
        checkpoint: rows an earlier run logged after it do not count)."""
        log = self.run_dir / "metrics.jsonl"

        def logged() -> bool:
            with contextlib.suppress(FileNotFoundError):
                return log.stat().st_mtime >= self.started and len(rows(self.run_dir)) >= n
            return False

        self.wait_for(logged, f"step {n}")

    def finish(self, timeout: float = 240.0) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def kill_while_checkpointing(d: Driver) -> str:
    """SIGKILL the driver and the learner rank while a checkpoint is half-written: at each ``.tmp-*``
    folder seen, both are frozen (SIGSTOP); if the folder is still there, they are killed, else thawed to
    wait for the next checkpoint. Returns the half-written checkpoint's name."""
    root = d.run_dir / "checkpoints"
    while True:
        d.wait_for(lambda: any(root.glob(".tmp-step_*")), "a checkpoint being written", poll=0.0005)
        frozen = [psutil.Process(d.proc.pid), *ray_workers("LearnerWorker", d.started)]
        for p in frozen:
            p.send_signal(signal.SIGSTOP)
        tmp = sorted(root.glob(".tmp-step_*"))
        if tmp and not (root / tmp[0].name.removeprefix(".tmp-")).exists():
            for p in frozen:
                p.kill()
            d.proc.wait(timeout=30)
            return tmp[0].name
        for p in frozen:
            p.send_signal(signal.SIGCONT)


def kill_worker(d: Driver, kind: str) -> float:
    """SIGKILL this run's ``ray::<kind>`` process; returns when (monotonic)."""
    (worker,) = ray_workers(kind, d.started)
    worker.kill()
    return time.monotonic()


def freeze_in_call(d: Driver, p: psutil.Process, method: str) -> None:
    """SIGSTOP the Ray actor process ``p`` while it runs ``method`` (Ray titles a worker
    ``ray::<Class>.<method>`` during a call): at each such title seen it is frozen, and thawed again if
    the call had ended meanwhile."""

    def title() -> str:
        return " ".join(p.cmdline())

    while True:
        d.wait_for(lambda: f".{method}" in title(), f"a call to {method}", poll=0.0005)
        p.send_signal(signal.SIGSTOP)
        if f".{method}" in title():
            return
        p.send_signal(signal.SIGCONT)


def assert_died_naming(d: Driver, killed_at: float, name: str) -> None:
    rc, _, err = d.finish(timeout=120)
    took = time.monotonic() - killed_at
    last = err.strip().splitlines()[-1]
    assert rc == 1, err[-3000:]
    assert took < 60, f"the run took {took:.0f} s to notice"
    assert last.startswith(f"error: {name} died (") and "rerun with --ckpt.load_enable" in last, last


def same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


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

    # 2. the learner rank's process, at a random step: the run ends at once, naming it
    every_step = [*sft_flags, "--ckpt.save_steps", "1", "--ckpt.load_enable"]
    d = Driver("sft", every_step, address, run_dir)
    d.wait_steps(rng.randint(int(latest[-6:]) + 1, SFT_STEPS - 2))
    assert_died_naming(d, kill_worker(d, "LearnerWorker"), "the model group's rank 0")

    # 3. to the end: the weights and the metrics of the uninterrupted run (the half-written checkpoint
    # was never taken; it is replaced when its step is saved again)
    rc, _, err = Driver("sft", every_step, address, run_dir).finish()
    assert rc == 0, err[-3000:]
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


# ---- rlhf ppo ------------------------------------------------------------------------------------------

PPO_STEPS = 10


@pytest.fixture(scope="module")
def ppo_flags(demo_model_dir) -> list[str]:
    """The built-in task on the demo model, REINFORCE++ (no critic, no reference), the transformers
    engine (what dies is an engine process either way), a checkpoint every 2 steps."""
    return [
        *("--actor.pretrain", str(demo_model_dir), "--rollout.backend", "transformers"),
        *("--algo.advantage.estimator", "reinforce", "--algo.kl.coef", "0"),
        *("--train.num_steps", str(PPO_STEPS), "--rollout.batch_size", "4"),
        *("--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "6"),
        *("--train.micro_batch_size", "8", "--eval.every", "0", "--ckpt.save_steps", "2", *QUIET),
    ]


def test_ppo_killed_at_the_driver_and_the_engine_twice_ends_as_an_uninterrupted_run(
    rng, ray_start_cluster, ppo_flags, tmp_path
):
    def driver(flags: list[str], run_dir: Path) -> Driver:
        return Driver("ppo", flags, ray_start_cluster, run_dir, env=CLUSTER_ENV)

    rc, _, err = driver(ppo_flags, tmp_path / "whole").finish()
    assert rc == 0, err[-3000:]
    run_dir = tmp_path / "killed"

    d = driver(ppo_flags, run_dir)  # 1. the driver, at a random step
    d.wait_steps(rng.randint(3, 5))
    d.kill()

    resume = [*ppo_flags, "--ckpt.load_enable"]
    latest = run_dir / "checkpoints" / "latest"
    # 2. and 3. the engine, frozen in a generation, then in a weight sync, and killed there
    for method in ("generate", "receive_weights"):
        d = driver(resume, run_dir)
        d.wait_steps(int(latest.read_text()[-6:]) + 1)
        (engine,) = ray_workers("EngineActor", d.started)
        freeze_in_call(d, engine, method)
        assert_died_naming(d, kill_worker(d, "EngineActor"), "rollout engine 0")

    rc, _, err = driver(resume, run_dir).finish()  # 4. to the end
    assert rc == 0, err[-3000:]
    assert training_metrics(run_dir) == training_metrics(tmp_path / "whole")
    same_weights(run_dir / "final_model", tmp_path / "whole" / "final_model")
    last = rows(run_dir)[-1]  # the engines held the learner's weights after every sync
    assert last["sync/weight_version"] == PPO_STEPS + 1 and last["sync/logp_mismatch_max"] < 1e-3
