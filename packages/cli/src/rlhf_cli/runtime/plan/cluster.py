"""Ray for one run: start a local cluster on loopback or join ``--ray.address``, what it offers, and the
placement groups of a plan (each one's removal registered with the run the moment it is created)."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from rlhf_cli.config import ConfigError, OfflineConfig, PPOConfig
from rlhf_cli.runtime.plan.types import ClusterResources
from rlhf_cli.runtime.runs.failures import Stops

if TYPE_CHECKING:
    from rlhf_cli.runtime.plan.types import Plan

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Read by Ray once, when first imported: ``0`` makes a local cluster listen on loopback only."""

__all__ = [
    "LOOPBACK_ENV",
    "ClusterResources",
    "PlacementGroups",
    "check_host_memory",
    "local_resources",
    "placement_groups",
    "start_ray",
]


def _host_memory_gib() -> float:
    import psutil

    return psutil.virtual_memory().total / 2**30


def _gpu_memory_gib() -> float | None:
    """Total memory of this process's first CUDA device in GiB, or None without one."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def check_host_memory(
    resources: ClusterResources, *, gib: float, processes: int, what: str, flag: str
) -> None:
    """ConfigError naming ``flag`` when ``processes`` processes (``what``) of ``gib`` GiB each cannot fit a
    node's memory (``host_memory_gib``): one of them alone, or on a one-node cluster all of them together."""
    host = resources.host_memory_gib
    on_a_node = processes if resources.nodes <= 1 else 1
    if host is not None and gib * on_a_node > host:
        raise ConfigError(
            f"{flag} {gib:g} x {on_a_node} {what} on a node is more than its {host:.1f} GiB of memory; "
            f"lower {flag}"
        )


def local_resources(cfg: PPOConfig | OfflineConfig) -> ClusterResources:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ClusterResources(
        cpus=float(cfg.ray.num_cpus or os.cpu_count() or 1),
        gpus=gpus,
        nodes=1,
        node_ips=("127.0.0.1",),
        gpu_memory_gib=_gpu_memory_gib() if gpus else None,
        host_memory_gib=_host_memory_gib(),
    )


def start_ray(cfg: PPOConfig | OfflineConfig) -> tuple[ClusterResources, bool]:
    """Join ``--ray.address`` / ``RAY_ADDRESS``, or start a local cluster that listens on 127.0.0.1 only
    (an already initialised Ray in this process is used as it is). Returns the resources and whether
    this call started Ray (so the recipe knows to stop it).

    Ray binds its servers to loopback only when ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is in the
    environment when ``ray`` is first imported: for a local cluster this sets it (unless set) before
    importing Ray, and refuses to start one when Ray was imported earlier without it.
    ``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0`` must also be set before Ray is first imported: the ``rlhf``
    command does it (``rlhf_cli.main``); a Python driver under ``uv run`` sets it itself."""
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if not address:
        _loopback_only()
    import ray

    from rlhf_cli.runtime.learners import tensor_wire

    started = False
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        else:
            logging.getLogger(_TOKEN_SETUP).addFilter(_not_token_auth_notice)
            ray.init(
                num_cpus=cfg.ray.num_cpus or os.cpu_count(),
                include_dashboard=False,
                log_to_driver=False,
                _node_ip_address="127.0.0.1",
                logging_level=logging.WARNING,  # not "Started a local Ray instance" on every run
            )
        started = True
    tensor_wire.register()
    total = ray.cluster_resources()
    ips = tuple(sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}))
    gpus = int(total.get("GPU", 0))
    return ClusterResources(
        cpus=float(total.get("CPU", 0)),
        gpus=gpus,
        nodes=len(ips),
        node_ips=ips,
        gpu_memory_gib=_gpu_memory_gib() if gpus else None,  # the driver's node's, as a sample
        host_memory_gib=None if address else _host_memory_gib(),
    ), started


_TOKEN_SETUP = "ray._private.authentication.authentication_token_setup"


def _not_token_auth_notice(record: logging.LogRecord) -> bool:
    """Ray's notice, on every local start, that token authentication is on (the default we keep)."""
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def _loopback_only() -> None:
    """Make a local Ray listen on loopback only (see :func:`start_ray`)."""
    import sys

    os.environ.setdefault(LOOPBACK_ENV, "0")
    if "ray" not in sys.modules:
        return
    from ray._private import ray_constants

    wanted = os.environ[LOOPBACK_ENV] == "0"  # not an explicit opt-out (=1)
    if wanted and ray_constants.ENABLE_RAY_CLUSTER and not sys.modules["ray"].is_initialized():
        raise RuntimeError(
            f"Ray was imported before {LOOPBACK_ENV}=0 was set, so a local cluster would listen on every "
            f"network interface: set {LOOPBACK_ENV}=0 before importing ray, or join a cluster with "
            "--ray.address"
        )


class PlacementGroups:
    """The run's placement groups by group name; each one removed once, early (``free``) or at the end."""

    def __init__(self) -> None:
        self._groups: dict[str, Any] = {}
        self._aliases: dict[str, str] = {}  # a colocated group -> the group whose placement group it uses
        self._order: dict[str, list[int]] = {}  # a spanning group: its bundles, the driver's node's first

    def __getitem__(self, name: str) -> Any:
        return self._groups[self._aliases.get(name, name)]

    def __contains__(self, name: str) -> bool:
        return self._aliases.get(name, name) in self._groups

    def alias(self, name: str, host: str) -> None:
        """``name`` sits on ``host``'s placement group (colocated); freeing ``name`` leaves it."""
        self._aliases[name] = host

    def add(self, name: str, pg: Any) -> None:
        self._groups[name] = pg

    def bundle(self, name: str, index: int) -> int:
        """The bundle of ``name``'s placement group that the plan's bundle ``index`` is (the plan's
        ``GroupPlan.bundle_index``): a spanning group's first is on the driver's node if it has one there,
        so rank 0 (the weight sender, the rendezvous master) runs beside the driver."""
        order = self._order.get(self._aliases.get(name, name))
        return order[index] if order else index

    def put_driver_node_first(self, name: str) -> None:
        """Number ``name``'s bundles from the one on this driver's node (a placed group)."""
        import ray
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(self._groups[name])["bundles_to_node_id"]
        here = ray.get_runtime_context().get_node_id()
        self._order[name] = sorted(range(len(nodes)), key=lambda b: nodes[b] != here)

    def free(self, name: str) -> None:
        """Remove ``name``'s placement group, if it is still there (a colocated group's: nothing)."""
        from ray.util.placement_group import remove_placement_group

        if self._aliases.pop(name, None) is not None:
            return
        pg = self._groups.pop(name, None)
        if pg is not None:
            remove_placement_group(pg)

    def free_all(self) -> None:
        for name in list(self._groups):
            self.free(name)


def placement_groups(
    plan: Plan,
    *,
    timeout_s: float,
    stop_at_exit: Stops,
    skip: tuple[str, ...] = (),
) -> PlacementGroups:
    """One placement group per group (except ``skip``): its ranks PACKed close together, or, for a group
    that spans nodes (``--<group>.num_nodes``), one bundle per node, STRICT_SPREAD. Colocated groups sit
    on their host's, whose bundles hold every member's claim. The spanning groups are placed first (the
    others then take what is left on each node). Their removal is registered with ``stop_at_exit``
    before the first is created. Waits until all are placed."""
    import ray
    from ray.util.placement_group import placement_group

    out = PlacementGroups()
    stop_at_exit(out.free_all)
    deadline = time.monotonic() + timeout_s
    spanning = [g for g in plan.groups if g.nodes > 1]
    for batch in (spanning, [g for g in plan.groups if g.nodes == 1]):
        for g in batch:
            if g.share is not None:
                out.alias(g.name, g.share)
            elif g.name not in skip or g.members:
                whole = {k: v * (1 + len(g.members)) for k, v in g.bundle.items()}  # every member's claim
                if g.nodes > 1:  # a node's processes share its bundle
                    per_node = {k: v * (g.processes // g.nodes) for k, v in whole.items()}
                    bundles, strategy = [dict(per_node) for _ in range(g.nodes)], "STRICT_SPREAD"
                else:
                    bundles, strategy = [dict(whole) for _ in range(g.processes)], "PACK"
                out.add(g.name, placement_group(bundles, strategy=strategy, name=f"rlhf-{g.name}"))
        ready = [out[g.name].ready() for g in batch if g.name in out and g.share is None]
        ray.get(ready, timeout=max(deadline - time.monotonic(), 0.001))
    for g in spanning:
        if g.share is None and g.name in out:
            out.put_driver_node_first(g.name)
    return out
