"""The leftover-process check: an orphan (its parent exited) is re-parented to the test process and
reported with its command; once it is gone nothing is; long-lived pool processes are not reported."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
from rlhf_testkit.leftovers import become_subreaper, descendants, leftovers


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
