"""Colocated groups (the hybrid engine): groups that share one placement group's bundles, each process
claiming an equal share of its bundle (a GPU, or a CPU bundle's cores)."""

from __future__ import annotations

from dataclasses import replace

from rlhf_cli.config.loading import ConfigError
from rlhf_cli.runtime.plan.types import GroupPlan

__all__ = ["colocate", "colocation_lines"]


def colocate(groups: list[GroupPlan], sets: list[tuple[str, ...]]) -> list[GroupPlan]:
    """``groups`` with each set in ``sets`` on one placement group: the set's group with the most
    processes hosts it (its bundles hold every member's claim); process ``i`` of each member sits on the
    host's bundle ``i`` (so rank ``i`` of the actor and engine ``i`` share a GPU) and claims
    ``1 / len(set)`` of it. ConfigError when a member has more processes than the host has bundles, or
    spans nodes (``--<group>.num_nodes`` > 1)."""
    by_name = {g.name: g for g in groups}
    for names in sets:
        members = [by_name[n] for n in names]
        spanning = [g.name for g in members if g.nodes > 1]
        if spanning:
            raise ConfigError(
                f"--train.colocate_*: --{spanning[0]}.num_nodes > 1 spreads {spanning[0]} over nodes; colocated "
                "groups share one placement group's bundles on one node each (drop the colocation or num_nodes)"
            )
        host = max(members, key=lambda g: g.processes)
        for g in members:
            if g.bundle != members[0].bundle:
                raise ConfigError(f"--train.colocate_*: {g.name} and {members[0].name} claim other resources")
        share = {k: v / len(members) for k, v in host.bundle.items()}
        others = tuple(g.name for g in members if g is not host)
        for g in members:
            by_name[g.name] = replace(
                g,
                bundle=share,
                share=None if g is host else host.name,
                members=others if g is host else (),
            )
    return [by_name[g.name] for g in groups]


def colocation_lines(groups: list[GroupPlan], device_gib: float | None, *, engines: int = 1) -> list[str]:
    """For ``--dry-run``: each colocated set, and the memory its processes need on one device; ConfigError
    when that exceeds a GPU, or when more than one engine process shares GPUs with the actor (the weights
    go over CUDA IPC from actor rank 0, which sees one GPU)."""
    lines = []
    for host in (g for g in groups if g.members):
        members = [host] + [g for g in groups if g.share == host.name]
        need = sum(g.memory_gib for g in members)
        names = {g.name for g in members}
        if host.bundle.get("GPU") and {"actor", "engines"} <= names and engines > 1:
            raise ConfigError(
                f"--train.colocate_all on GPUs: {engines} engine processes would share the actor's GPUs, but "
                "CUDA IPC reaches only actor rank 0's; use one engine with --rollout.tensor_parallel_size 1"
            )
        if host.bundle.get("GPU") and device_gib is not None and need > device_gib:
            raise ConfigError(
                f"--train.colocate_*: {' + '.join(sorted(names))} need {need:.2f} GiB on one GPU of "
                f"{device_gib:.2f} GiB; lower --rollout.gpu_memory_utilization or colocate fewer groups"
            )
        label = " + ".join(g.name for g in members)
        if host.bundle.get("GPU"):
            fits = "" if device_gib is None else f" of {device_gib:.1f} GiB"
            where = f"{need:.2f} GiB per GPU{fits} (engines sleep while the learners train)"
        else:
            where = f"{need:.2f} GiB per bundle (on CPU they share the cores; vLLM-CPU cannot sleep)"
        lines.append(f"colocated: {label} share {host.name}'s {host.processes} bundle(s); {where}")
    return lines
