"""Core binding (``rlhf_rollout.cores``): what a thread starts while bound keeps the binding, and
``bind_all_threads`` releases every thread of the process again (an asynchronous engine's front end)."""

from __future__ import annotations

import os
import threading

import pytest
from rlhf_rollout.cores import bind_all_threads, pin_to_cores, split_for_workers


def test_threads_started_while_bound_keep_the_binding_until_all_threads_are_released():
    allowed = os.sched_getaffinity(0)
    started, stop = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def pinned_then_start() -> None:
        ids = pin_to_cores([1])
        child = threading.Thread(target=lambda: (started.set(), stop.wait(30)))
        child.start()
        started.wait(30)
        seen["pinned"], seen["child"] = set(ids), os.sched_getaffinity(child.native_id)
        bind_all_threads(allowed)
        seen["released"], seen["child after"] = os.sched_getaffinity(0), os.sched_getaffinity(child.native_id)
        stop.set()
        child.join(30)

    env = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    try:
        t = threading.Thread(target=pinned_then_start)  # a thread of its own: the test's stays unbound
        t.start()
        t.join(60)
    finally:
        if env is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = env
    one = {sorted(allowed)[1 % len(allowed)]}  # the second core it may run on
    assert seen["pinned"] == seen["child"] == one
    assert seen["released"] == seen["child after"] == allowed
    assert os.sched_getaffinity(0) == allowed


def test_a_sharded_cpu_engine_gives_each_worker_a_run_of_its_cores():
    allowed = sorted(os.sched_getaffinity(0))
    for workers in range(1, len(allowed) + 1):
        runs = [[int(c) for c in run.split(",")] for run in split_for_workers(workers).split("|")]
        assert len(runs) == workers and [c for run in runs for c in run] == allowed  # contiguous, each once
        assert max(map(len, runs)) - min(map(len, runs)) <= 1
    with pytest.raises(ValueError, match=f"a CPU engine needs a core per worker, it has {len(allowed)}"):
        split_for_workers(len(allowed) + 1)


def test_cores_are_ordered_so_that_halves_and_runs_hold_whole_physical_cores():
    from rlhf_rollout.cores import in_topology_order

    smt = {cpu: (0, cpu % 4) for cpu in range(8)}  # 4 cores, threads i and i + 4 (Linux's usual numbering)
    order = in_topology_order(range(8), lambda cpu: smt[cpu])
    assert order == [0, 4, 1, 5, 2, 6, 3, 7]
    assert {smt[c] for c in order[:4]}.isdisjoint({smt[c] for c in order[4:]})  # engines' half, learners'
    two_sockets = {0: (1, 0), 1: (0, 0), 2: (1, 1), 3: (0, 1)}
    assert in_topology_order([0, 1, 2, 3], lambda cpu: two_sockets[cpu]) == [1, 3, 0, 2]

    def unreadable(cpu):
        raise OSError("no sysfs")

    assert in_topology_order([3, 1, 2], unreadable) == [1, 2, 3]
