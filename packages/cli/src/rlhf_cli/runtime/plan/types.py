"""The plan's data: what the cluster offers and which group gets which bundles and memory. Imports nothing
from the placement logic, so the modules that use a plan (threads, colocation, placement groups) import
this one and never each other in a circle."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ClusterResources", "GroupPlan", "Plan", "parts_note"]


@dataclass(frozen=True, kw_only=True)
class ClusterResources:
    cpus: float
    gpus: int
    nodes: int
    node_ips: tuple[str, ...] = ()
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB (this machine's first GPU; on a Ray cluster the driver's node's); None:
    unknown or no GPU, and then plans are not checked against device memory."""
    host_memory_gib: float | None = None
    """Memory of the one node of a local cluster in GiB; None (a joined cluster, whose nodes may differ
    from the driver's): CPU engines' KV caches are not checked against it."""


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    name: str
    """actor, critic, ref, reward, model or engines."""
    processes: int
    bundle: dict[str, float]
    """Resources of each bundle (one per process)."""
    parts: dict[str, float]
    """Memory per process in GiB: weights, grads+optimizer, activations (learners on GPU), KV (engines)."""
    params: int = 0
    note: str = ""
    flags: tuple[str, ...] = ()
    """Flags that lower this group's memory (named when a GPU cannot hold it)."""
    threads: int = 0
    """torch threads of each rank or CPU engine process (0: the group sets its own, e.g. GPU engines)."""
    cores: tuple[int, ...] = ()
    """CPU runs with pinned cores: the cores (indices into each node's allowed cores) this group's
    processes on a node are bound to; empty: not pinned."""
    share: str | None = None
    """Colocated: the group whose placement group (bundles) this one's processes sit on."""
    members: tuple[str, ...] = ()
    """Colocated, on the hosting group: the groups that share its bundles."""
    nodes: int = 1
    """Nodes the processes span, ``processes // nodes`` on each: one bundle per node, every bundle on a
    node of its own (``--<group>.num_nodes``). 1: one bundle per process, packed onto as few nodes as fit."""

    def bundle_index(self, process: int) -> int:
        """The bundle that process ``process`` (a rank, or a colocated member's process) sits on."""
        return process // (self.processes // self.nodes) if self.nodes > 1 else process

    @property
    def memory_gib(self) -> float:
        return sum(self.parts.values())


@dataclass(frozen=True, kw_only=True)
class Plan:
    device: str
    """cuda or cpu."""
    groups: list[GroupPlan]
    transport: str
    transport_reason: str = ""
    """Why the weight sync's GPU transport fits the placement (empty for the host-memory ones)."""
    resources: ClusterResources
    num_params: int
    """The actor's (offline: the trained model's) parameters."""
    notes: list[str] = field(default_factory=list)

    def group(self, name: str) -> GroupPlan | None:
        return next((g for g in self.groups if g.name == name), None)

    def render(self) -> str:
        lines = [
            f"cluster: {self.resources.nodes} node(s), {self.resources.cpus:g} CPUs, {self.resources.gpus} GPUs "
            f"-> {self.device} bundles; model: {self.num_params / 1e6:.2f}M parameters",
            f"{'group':<8} {'processes':>9}  {'bundle each':<22} {'memory each':>11}  note",
        ]
        for g in self.groups:
            bundle = ", ".join(f"{k}: {v:g}" for k, v in g.bundle.items())
            threads = f"; {g.threads} thread(s) each" if g.threads else ""
            threads += f" on core(s) {_span(g.cores)}" if g.cores else ""
            threads += f"; {g.processes // g.nodes} on each of {g.nodes} nodes" if g.nodes > 1 else ""
            note = f"{g.note}{threads}; {g.params / 1e6:.2f}M params: {parts_note(g.parts)}"
            lines.append(f"{g.name:<8} {g.processes:>9}  {bundle:<22} {g.memory_gib:>8.2f} GiB  {note}")
        if (e := self.group("engines")) is not None:
            sync = f"weight sync: actor rank 0 -> {e.processes} engine process(es) over {self.transport}"
            sync += f" ({self.transport_reason})" if self.transport_reason else ""
            lines.append(sync)
        lines += self.notes
        return "\n".join(lines)


def _span(cores: tuple[int, ...]) -> str:
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])


def parts_note(parts: dict[str, float]) -> str:
    return " + ".join(f"{k} {v:.2f}" for k, v in parts.items()) + " GiB"
