"""The leftover-process check: an orphan (its parent exited) is re-parented to the test process and
reported with its command; once it is gone nothing is; long-lived pool processes are not reported; a
step of the wall clock does not make running processes look new."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from rlhf_testkit.leftovers import become_subreaper, descendants, leftovers, started


def test_an_orphan_is_reparented_here_and_reported_until_it_is_gone():
    assert become_subreaper()
    before = descendants()
    subprocess.run(["sh", "-c", "sleep 120 >/dev/null 2>&1 &"], check=True)
    deadline = time.monotonic() + 30
    while [p.command for p in leftovers(before, grace_s=0.0)] != ["sleep 120"]:  # until it has exec'd
        assert time.monotonic() < deadline, leftovers(before, grace_s=0.0)
        time.sleep(0.01)
    (orphan,) = leftovers(before, grace_s=0.0)
    assert psutil.Process(orphan.pid).ppid() == os.getpid()  # not init's: its parent shell has exited
    psutil.Process(orphan.pid).kill()
    assert leftovers(before, grace_s=5.0) == []  # killed: a zombie, not a running process


def test_pooled_processes_are_not_leftovers():
    before = descendants()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "ray::IDLE"])
    try:
        assert leftovers(before, grace_s=0.0) == []
    finally:
        proc.kill()
        proc.wait()


def test_a_wall_clock_step_does_not_make_running_processes_look_new_nor_moves_their_start(monkeypatch):
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert (
            since_boot - 0.02 <= started(psutil.Process(proc.pid)) <= time.clock_gettime(time.CLOCK_BOOTTIME)
        )
        before = descendants()
        created = psutil.Process(proc.pid).create_time()
        stepped = psutil.boot_time() + 1.0  # what /proc/stat's btime reads after NTP steps the clock by 1 s
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: stepped)
        assert psutil.Process(proc.pid).create_time() == pytest.approx(created + 1.0)  # psutil's moves
        assert leftovers(before, grace_s=0.0) == []
    finally:
        proc.kill()
        proc.wait()
