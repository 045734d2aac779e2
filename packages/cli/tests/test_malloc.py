"""glibc's malloc keeps freed memory in a run's processes: the CLI sets it before it starts Ray, every
learner rank and engine gets it, the user's own malloc settings win, and with it a freed block is reused
instead of faulting in fresh pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rlhf_cli.runtime.host import malloc
from rlhf_cli.runtime.host.malloc import MALLOC_SETTINGS, MMAP_THRESHOLD, TRIM_THRESHOLD, malloc_env
from rlhf_cli.runtime.learners.group import worker_env

OURS = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


@pytest.fixture
def plain_env(monkeypatch):
    for name in (*MALLOC_SETTINGS, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_ranks_and_engines_get_it_unless_the_user_tunes_malloc(plain_env):
    assert OURS.items() <= worker_env().items()
    plain_env.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    env = worker_env()
    assert env["MALLOC_TRIM_THRESHOLD_"] == "0" and "MALLOC_MMAP_THRESHOLD_" not in env
    assert malloc_env({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) == {}
    assert malloc_env({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=4096"}) == OURS
    assert malloc_env({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}) == {}
    plain_env.delenv("MALLOC_TRIM_THRESHOLD_")
    plain_env.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096")
    env = worker_env()
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.mmap_threshold=4096" and "MALLOC_MMAP_THRESHOLD_" not in env
    plain_env.delenv("GLIBC_TUNABLES")
    plain_env.setenv("MALLOC_ARENA_MAX", "2")  # not a threshold: ours too, and the user's passed on
    assert worker_env().items() >= (OURS | {"MALLOC_ARENA_MAX": "2"}).items()


@pytest.mark.parametrize(("version", "set_"), [((2, 34), False), ((2, 35), True), (None, False)])
def test_left_out_where_glibc_would_ignore_a_threshold_over_32_mib(plain_env, version, set_):
    plain_env.setattr(malloc, "glibc_version", lambda: version)  # before 2.35 it caps the threshold
    assert malloc_env({}) == (OURS if set_ else {})


def test_the_command_sets_it_for_the_processes_it_starts(plain_env):
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_SETTINGS}
    code = "import os, rlhf_cli.main; print(os.environ['MALLOC_MMAP_THRESHOLD_'], os.environ['MALLOC_TRIM_THRESHOLD_'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [OURS["MALLOC_MMAP_THRESHOLD_"], OURS["MALLOC_TRIM_THRESHOLD_"]]


_FAULTS = """
import ctypes, resource
libc = ctypes.CDLL("libc.so.6")
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, whatever the machine's huge-page setting
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # a step's 40 MB of activations: allocated, written, freed
    p = libc.malloc(40 << 20); ctypes.memset(p, 1, 40 << 20); libc.free(p)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_freed_block_is_reused_instead_of_faulting_in_fresh_pages(plain_env):
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_SETTINGS}

    def faults(extra: dict[str, str]) -> int:
        run = subprocess.run(
            [sys.executable, "-c", _FAULTS], env=env | extra, capture_output=True, text=True, timeout=60
        )
        assert run.returncode == 0, run.stderr[-2000:]
        return int(run.stdout)

    pages = (40 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert faults({}) > 5 * pages  # glibc's default: each 40 MB block is a mapping of its own
    assert faults(malloc_env({})) < 2 * pages  # faulted in once, then reused
