"""Binding a process to some of its node's cores (engines and learners on disjoint cores)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

__all__ = [
    "allowed_cores",
    "bind_all_threads",
    "bind_sharded_workers",
    "in_topology_order",
    "pin_to_cores",
    "split_for_workers",
]


def _physical_core(cpu: int) -> tuple[int, int]:
    """``(package, core)`` of a logical CPU, from Linux's sysfs topology."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    with open(base + "physical_package_id") as package, open(base + "core_id") as core:
        return int(package.read()), int(core.read())


def in_topology_order(
    cpus: Iterable[int], physical_core: Callable[[int], tuple[int, int]] = _physical_core
) -> list[int]:
    """Logical CPUs ordered by the physical core they are threads of (``physical_core``: ``(package,
    core)``), so that a contiguous run of them, or the first half, holds whole physical cores: Linux often
    numbers a core's two SMT threads ``i`` and ``i + n``, and a split by number would put both halves on
    the same cores. By number where the topology cannot be read."""
    cpus = sorted(cpus)
    try:
        return sorted(cpus, key=lambda c: (*physical_core(c), c))
    except (OSError, ValueError):
        return cpus


def allowed_cores() -> list[int]:
    """The logical CPUs this process may run on (``os.sched_getaffinity``), :func:`in_topology_order`."""
    return in_topology_order(os.sched_getaffinity(0))


def pin_to_cores(cpu_cores: Sequence[int]) -> list[int]:
    """Bind the calling thread (and the processes and threads it starts from now on) to ``cpu_cores``,
    indices into the cores it may run on (:func:`allowed_cores`: whole physical cores first): an engine started in-process runs its
    OpenMP threads on them; vLLM's multiprocess executor binds its workers' threads to them
    (``VLLM_CPU_OMP_THREADS_BIND``). Returns the core ids."""
    allowed = allowed_cores()
    ids = sorted({allowed[i % len(allowed)] for i in cpu_cores})
    os.sched_setaffinity(0, ids)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, ids))
    return ids


def split_for_workers(workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine of ``workers`` CPU workers (tensor parallel): the cores
    this process may run on (its pinned ones, else all it is allowed; :func:`allowed_cores`) in that many
    contiguous runs, one per worker (``"0,1|2,3"``). vLLM-CPU binds them itself only across NUMA nodes, one worker per node."""
    cores = allowed_cores()
    if len(cores) < workers:
        raise ValueError(
            f"tensor_parallel_size {workers}: a CPU engine needs a core per worker, it has {len(cores)}"
        )
    per, extra = divmod(len(cores), workers)
    runs, start = [], 0
    for w in range(workers):
        end = start + per + (1 if w < extra else 0)
        runs.append(",".join(map(str, cores[start:end])))
        start = end
    return "|".join(runs)


def bind_sharded_workers(engine_kwargs: dict) -> None:
    """Before a vLLM engine starts: the workers of one sharded over vLLM-CPU's multiprocess executor
    (``distributed_executor_backend="mp"``, ``tensor_parallel_size > 1``) each on its own run of this
    process's cores (:func:`split_for_workers`)."""
    tp = int(engine_kwargs.get("tensor_parallel_size", 1))
    if engine_kwargs.get("distributed_executor_backend") == "mp" and tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = split_for_workers(tp)


def bind_all_threads(cores: set[int]) -> None:
    """Bind every thread of this process to ``cores`` (e.g. back to all it had, once an engine started while
    bound has made its own threads and processes, which keep the binding they were started with)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread that has ended meanwhile
            continue
