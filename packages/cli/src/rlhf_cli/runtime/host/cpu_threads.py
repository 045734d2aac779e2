"""CPU runs: the torch threads of each learner rank and engine process, and pinned cores (engines on one
half of each node's cores, learners on the other) -- part of the placement plan."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from rlhf_cli.config import ConfigError
from rlhf_cli.runtime.plan.types import ClusterResources

if TYPE_CHECKING:
    from rlhf_cli.runtime.plan.types import GroupPlan

__all__ = ["check_engine_workers", "engine_threads", "pinned", "with_threads"]


def with_threads(
    groups: list[GroupPlan],
    per_node: dict[str, int],
    resources: ClusterResources,
    threads_per_rank: int | None,
) -> list[GroupPlan]:
    """Each learner group's torch threads per rank: ``--ray.threads_per_rank``, else one for a tiny model,
    else its node's cores divided by the group's ranks on the node (``per_node``): the stages of a
    synchronous step run one at a time, so the group running owns the node's cores (a fractional Ray CPU
    would give it one thread)."""
    cores = max(1, int(resources.cpus // max(1, resources.nodes)))

    def threads(g: GroupPlan) -> int:
        if threads_per_rank:
            return threads_per_rank
        return 1 if 0 < g.params < _ONE_THREAD_PARAMS else max(1, cores // per_node[g.name])

    return [replace(g, threads=threads(g)) if g.name in per_node else g for g in groups]


def pinned(
    groups: list[GroupPlan],
    per_node: dict[str, int],
    resources: ClusterResources,
    floating: tuple[str, ...] = (),
) -> list[GroupPlan]:
    """Engines and learner ranks on disjoint cores of each node (their work overlaps when training is
    asynchronous, and OpenMP threads that share a core wait for each other): the engines the first half,
    the other groups the rest; each process's threads are its share of its half (the groups of a half take
    turns, so each gets all). The groups in ``floating`` are bound to no core, with the threads of a half
    (their work overlaps both halves: the OS gives it what either leaves idle)."""
    cores = max(1, int(resources.cpus // max(1, resources.nodes)))
    if resources.gpus or cores < 2:
        return groups
    half = cores // 2
    engine_cores, learner_cores = tuple(range(half)), tuple(range(half, cores))
    out = []
    for g in groups:
        mine = engine_cores if g.name == "engines" else learner_cores
        procs = per_node.get(g.name, 1)
        threads = max(1, len(mine) // max(1, procs))
        out.append(replace(g, cores=() if g.name in floating else mine, threads=threads))
    return out


def check_engine_workers(
    groups: list[GroupPlan], resources: ClusterResources, *, tp: int, engines: int
) -> None:
    """CPU engines sharded over ``tp`` workers (``--rollout.tensor_parallel_size``) bind each worker to cores
    of its own, each engine to its share of its node's cores (when pinned: of the engines' half):
    ConfigError when an engine has fewer cores than workers."""
    g = next((g for g in groups if g.name == "engines"), None)
    if g is None or tp == 1 or resources.gpus:
        return
    per_node = -(-engines // max(1, resources.nodes))  # each engine takes its share of its node's cores
    cores = (len(g.cores) if g.cores else int(resources.cpus // max(1, resources.nodes))) // per_node
    if cores < tp:
        where = "of the engines' pinned cores" if g.cores else "of its node's"
        has = f"each engine has {cores} {where}"
        more = " (or --rollout.num_engines)" if per_node > 1 else ""
        more += ", or set --train.pin_cores false" if g.cores else ""
        raise ConfigError(
            f"--rollout.tensor_parallel_size {tp}: a CPU engine's workers need a core each, and {has}; lower it{more}"
        )


_ONE_THREAD_PARAMS = 5e6
"""Below this many parameters a CPU engine or learner rank gets one torch thread: its ops are too small to
gain from being split over threads (measurements: docs/performance.md)."""


def engine_threads(
    processes: int, resources: ClusterResources, threads_per_rank: int | None, params: int
) -> int:
    """A CPU engine's torch threads: ``--ray.threads_per_rank``, else one for a tiny model, else its
    node's cores divided by the engine processes on the node (spread evenly): in a synchronous step the
    learners wait while the engines generate (Ray would give a fractional-CPU actor one thread)."""
    if threads_per_rank:
        return threads_per_rank
    if params < _ONE_THREAD_PARAMS:
        return 1
    cores = max(1, int(resources.cpus // max(1, resources.nodes)))
    return max(1, cores // max(1, math.ceil(processes / max(1, resources.nodes))))
