"""Binding a process to some of its node's cores (engines and learners on disjoint cores)."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["pin_to_cores"]


def pin_to_cores(cpu_cores: Sequence[int]) -> list[int]:
    """Bind this process (and the processes and threads it starts) to ``cpu_cores``, indices into the
    cores it may run on (``os.sched_getaffinity``), and have vLLM-CPU bind its OpenMP threads to them
    (``VLLM_CPU_OMP_THREADS_BIND``). Returns the core ids."""
    allowed = sorted(os.sched_getaffinity(0))
    ids = sorted({allowed[i % len(allowed)] for i in cpu_cores})
    os.sched_setaffinity(0, ids)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, ids))
    return ids
