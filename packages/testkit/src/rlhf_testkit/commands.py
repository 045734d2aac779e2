"""Commands as users run them, for tests: an ``rlhf`` command in a subprocess of its own session (in a test
host or not), joined to a Ray cluster with ``--ray.address``; its logged metrics; its Ray worker processes,
to freeze or kill mid-call; and checks of how it ended."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from rlhf_testkit.hosts import Host
from rlhf_testkit.leftovers import started

__all__ = [
    "Driver",
    "assert_died_naming",
    "failed_within",
    "freeze_in_call",
    "kill_steps_rng",
    "kill_while_checkpointing",
    "kill_worker",
    "ray_workers",
    "rows",
    "same_weights",
    "training_metrics",
]

BIN = Path(sys.executable).parent


def kill_steps_rng() -> random.Random:
    """Where kill tests draw their kill steps from: seeded by ``RLHF_KILL_SEED`` (to replay a run), else
    by the clock; the seed is printed either way."""
    seed = int(os.environ.get("RLHF_KILL_SEED", time.time_ns() % 10_000))
    print(f"kill steps drawn with RLHF_KILL_SEED={seed}")
    return random.Random(seed)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # (one being written: not yet)


def training_metrics(run_dir: Path) -> list[dict]:
    """Every logged row without its timings and fault counts (which differ from run to run)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "fault/"))} for r in rows(run_dir)]


def ray_workers(kind: str, since_boot: float, host: Host | None = None) -> list[psutil.Process]:
    """The ``ray::<kind>`` processes started after ``since_boot`` (a run's start, in seconds since boot:
    ``Driver.started_since_boot``) by the Ray clusters this test process started (its descendants: never
    another test process's), in ``host`` if given."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.cmdline())
            mine = cmd.startswith(f"ray::{kind}") and started(p) >= since_boot - 1
            if mine and (host is None or host.holds(p.pid)):
                found.append(p)
    return found


class Driver:
    """``rlhf <command> <flags> --ray.address <address>`` in a subprocess of its own session (in ``host``
    when given)."""

    def __init__(
        self,
        command: str,
        flags: list[str],
        address: str,
        run_dir: Path,
        *,
        env: dict | None = None,
        host: Host | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.started = time.time()  # the wall clock, as log files' modification times are
        self.started_since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)  # unmoved by clock steps
        argv = [
            str(BIN / "rlhf"),
            command,
            *flags,
            "--ray.address",
            address,
            "--logger.run_dir",
            str(run_dir),
        ]
        self.proc = subprocess.Popen(
            host.command(argv) if host else argv,
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
        frozen = [psutil.Process(d.proc.pid), *ray_workers("LearnerWorker", d.started_since_boot)]
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
    (worker,) = ray_workers(kind, d.started_since_boot)
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
    last = failed_within(d, killed_at, 60)
    assert last.startswith(f"error: {name} died (") and "rerun with --ckpt.load_enable" in last, last


def failed_within(d: Driver, since: float, limit_s: float) -> str:
    """The run's last line of stderr, once it has ended with exit status 1 within ``limit_s`` of
    ``since`` (monotonic)."""
    rc, _, err = d.finish(timeout=120)
    took = time.monotonic() - since
    print(f"the run ended {took:.0f} s after the failure")
    assert rc == 1, err[-3000:]
    assert took < limit_s, f"the run took {took:.0f} s to notice"
    return err.strip().splitlines()[-1]


def same_weights(a: Path, b: Path) -> None:
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
