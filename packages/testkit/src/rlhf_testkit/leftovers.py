"""Processes a test leaves behind. The test process becomes a child subreaper (Linux), so a descendant whose
parent dies (a vLLM engine core after its actor was killed, a daemon that forked away) is re-parented to
it rather than to init: every process a test started stays in view, orphans included, and can be counted
once the test is done."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from dataclasses import dataclass, field

import psutil

__all__ = ["LONG_LIVED", "ProcessKey", "become_subreaper", "descendants", "leftovers", "started"]

PR_SET_CHILD_SUBREAPER = 36

LONG_LIVED = ("ray::IDLE", "multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Command-line parts of processes that live as long as what pooled them (a Ray node's idle workers, the
interpreter's own helpers), not as long as a test."""


@dataclass(frozen=True)
class ProcessKey:
    """A process, told apart from a later one that reuses its pid by when it started (:func:`started`);
    its command, shown in reports, is not part of its identity: Ray retitles a worker at every call."""

    pid: int
    started: float
    command: str = field(compare=False)

    def __str__(self) -> str:
        return f"{self.pid} {self.command[:120]!r}"


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants; False where the OS has no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def started(process: psutil.Process) -> float:
    """Seconds from boot to when ``process`` started (Linux's ``/proc/<pid>/stat`` field 22), on the clock
    of ``time.clock_gettime(time.CLOCK_BOOTTIME)``. Unlike ``create_time()`` it never changes while the
    process lives: that adds the boot time, which Linux derives from the wall clock, so a clock step (NTP)
    moves every process's ``create_time()`` at once."""
    try:
        with open(f"/proc/{process.pid}/stat", "rb") as f:
            after_command = f.read().rsplit(b")", 1)[1].split()  # the command may hold spaces and ")"
    except FileNotFoundError:
        raise psutil.NoSuchProcess(process.pid) from None
    return int(after_command[19]) / os.sysconf("SC_CLK_TCK")  # fields 3.. follow it; starttime is 22


def descendants() -> set[ProcessKey]:
    """This process's living descendants (zombies left out)."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            found.add(ProcessKey(p.pid, started(p), " ".join(p.cmdline()) or p.name()))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return found


def leftovers(before: set[ProcessKey], *, grace_s: float) -> list[ProcessKey]:
    """Descendants that were not in ``before`` and are not :data:`LONG_LIVED`, after waiting up to
    ``grace_s`` for them to exit (a killed actor's process takes a moment to go). Exited orphans stay
    zombies of this process until it ends (reaping them could take an exit status that a ``Popen``
    still waits for); they are not counted."""
    deadline = time.monotonic() + grace_s
    while True:
        left = sorted(
            (p for p in descendants() - before if not any(s in p.command for s in LONG_LIVED)),
            key=lambda p: p.pid,
        )
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)
