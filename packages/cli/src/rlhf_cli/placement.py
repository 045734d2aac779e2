"""Ray: start or join a cluster, plan which group gets which bundles, create the placement groups.

The plan is pure data computed from the configuration and the cluster's resources, so ``--dry-run``
prints it without starting anything heavy, and a plan that cannot fit is an error before start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlhf_learner import StrategyOptions

from rlhf_cli.config import ConfigError, OfflineConfig, PPOConfig
from rlhf_cli.config.run import RayConfig

__all__ = [
    "ClusterResources",
    "GroupPlan",
    "Plan",
    "local_resources",
    "make_offline_plan",
    "make_plan",
    "start_ray",
]


@dataclass(frozen=True, kw_only=True)
class ClusterResources:
    cpus: float
    gpus: int
    nodes: int
    node_ips: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    name: str
    """actor, critic, ref, reward or engines."""
    processes: int
    bundle: dict[str, float]
    """Resources of each bundle (one per process)."""
    memory_gib: float
    """Estimated memory per process (weights + gradients + optimizer states, or weights + KV cache)."""
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class Plan:
    device: str
    """cuda or cpu."""
    groups: list[GroupPlan]
    transport: str
    resources: ClusterResources
    num_params: int
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
            lines.append(f"{g.name:<8} {g.processes:>9}  {bundle:<22} {g.memory_gib:>8.2f} GiB  {g.note}")
        if self.group("engines") is not None:
            lines.append(
                f"weight sync: actor rank 0 -> {self.group('engines').processes} engine process(es) "
                f"over {self.transport}"
            )
        lines += self.notes
        return "\n".join(lines)


def local_resources(cfg: PPOConfig | OfflineConfig) -> ClusterResources:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ClusterResources(
        cpus=float(cfg.ray.num_cpus or os.cpu_count() or 1), gpus=gpus, nodes=1, node_ips=("127.0.0.1",)
    )


def count_params(model_dir: Path) -> int:
    """Parameters of a Hugging Face folder, from its config on the meta device (no weights loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _gib(n: float) -> float:
    return n / 2**30


def _bundle(resources: ClusterResources, ray_cfg: RayConfig) -> dict[str, float]:
    if resources.gpus > 0:
        return {"GPU": ray_cfg.gpus_per_worker, "CPU": 1.0}
    return {"CPU": ray_cfg.cpus_per_worker}


def _learner_group(
    name: str, world: int, *, trains: bool, num_params: int, ds: StrategyOptions, bundle: dict, note: str = ""
) -> GroupPlan:
    """A learner group's plan; memory: weights (+ fp32 gradients and Adam states when it trains),
    divided over the ranks as its ZeRO stage shards them."""
    bytes_w = 2 if ds.precision == "bf16" else 4
    stage = ds.zero_stage
    shard = lambda n, on: n / world if stage >= on else n  # noqa: E731
    if trains:
        weights, grads, adam = num_params * bytes_w, num_params * 4, num_params * 12  # fp32 master + moments
        mem = shard(weights, 3) + shard(grads, 2) + shard(adam, 1)
        note = note or f"ZeRO-{stage}, trains"
    else:
        mem = shard(num_params * bytes_w, 3)
        note = note or "frozen"
    return GroupPlan(name=name, processes=world, bundle=bundle, memory_gib=_gib(mem), note=note)


def _check_fits(groups: list[GroupPlan], resources: ClusterResources, ray_cfg: RayConfig, what: str) -> None:
    """Raise ConfigError naming the flags when the groups need more CPUs or GPUs than the cluster has."""
    need_cpu = sum(g.processes * g.bundle.get("CPU", 0) for g in groups)
    need_gpu = sum(g.processes * g.bundle.get("GPU", 0) for g in groups)
    if resources.gpus > 0 and need_gpu > resources.gpus:
        raise ConfigError(
            f"{what} need {need_gpu:g} GPUs ({ray_cfg.gpus_per_worker:g} each, --ray.gpus_per_worker); "
            f"the cluster has {resources.gpus}"
        )
    if need_cpu > resources.cpus + 1e-9:
        raise ConfigError(
            f"{what} need {need_cpu:g} CPUs ({ray_cfg.cpus_per_worker:g} each, --ray.cpus_per_worker); "
            f"the cluster has {resources.cpus:g}"
        )


def make_offline_plan(
    cfg: OfflineConfig, resources: ClusterResources, *, num_params: int, with_ref: bool
) -> Plan:
    """The trained group (``model``) and, for dpo / kto, the frozen reference (``ref``)."""
    bundle = _bundle(resources, cfg.ray)
    groups = [
        _learner_group(
            "model", cfg.model.world_size, trains=True, num_params=num_params, ds=cfg.ds, bundle=bundle
        )
    ]
    if with_ref:
        ref = cfg.ref  # type: ignore[attr-defined]
        note = "frozen, stopped after precomputing" if ref.precompute else "frozen"
        frozen = replace(cfg.ds, zero_stage=0) if cfg.ds.zero_stage in (1, 2) else cfg.ds
        groups.append(
            _learner_group(
                "ref",
                ref.world_size,
                trains=False,
                num_params=num_params,
                ds=frozen,
                bundle=bundle,
                note=note,
            )
        )
    _check_fits(groups, resources, cfg.ray, "the learner groups")
    return Plan(
        device="cuda" if resources.gpus > 0 else "cpu",
        groups=groups,
        transport="none",
        resources=resources,
        num_params=num_params,
    )


def make_plan(cfg: PPOConfig, resources: ClusterResources, *, num_params: int) -> Plan:
    """Processes, bundles and memory per group; raises ConfigError naming the flag when it cannot fit."""
    gpu = resources.gpus > 0
    per = _bundle(resources, cfg.ray)
    bytes_w = 2 if cfg.ds.precision == "bf16" else 4
    frozen_ds = replace(cfg.ds, zero_stage=0) if cfg.ds.zero_stage in (1, 2) else cfg.ds
    groups = [
        _learner_group(
            "actor", cfg.actor.world_size, trains=True, num_params=num_params, ds=cfg.ds, bundle=per
        )
    ]
    if cfg.uses_critic:
        groups.append(
            _learner_group(
                "critic", cfg.critic.world_size, trains=True, num_params=num_params, ds=cfg.ds, bundle=per
            )
        )
    if cfg.uses_reference:
        groups.append(
            _learner_group(
                "ref", cfg.ref.world_size, trains=False, num_params=num_params, ds=frozen_ds, bundle=per
            )
        )
    if cfg.reward.source == "model":
        groups.append(
            _learner_group(
                "reward",
                cfg.reward.world_size,
                trains=False,
                num_params=num_params,
                ds=frozen_ds,
                bundle=per,
                note="frozen reward model",
            )
        )
    engine_bundle = dict(per)
    kv = cfg.vllm.kv_cache_gib if not gpu else 0.0
    groups.append(
        GroupPlan(
            name="engines",
            processes=cfg.vllm.num_engines * cfg.vllm.tensor_parallel_size,
            bundle=engine_bundle,
            memory_gib=_gib(num_params * bytes_w / cfg.vllm.tensor_parallel_size) + kv,
            note=f"{cfg.vllm.num_engines} x {cfg.rollout.backend} engine(s), TP {cfg.vllm.tensor_parallel_size}",
        )
    )
    _check_fits(
        groups,
        resources,
        cfg.ray,
        f"--vllm.num_engines {cfg.vllm.num_engines} x --vllm.tensor_parallel_size "
        f"{cfg.vllm.tensor_parallel_size} engine process(es) and the learner groups",
    )
    transport = cfg.weightsync.transport
    if transport == "auto":
        one_host = len(set(resources.node_ips)) <= 1
        if gpu and cfg.rollout.backend == "vllm":  # NCCL needs one GPU per rank; shared GPUs use CUDA IPC
            transport = "nccl" if cfg.ray.gpus_per_worker == 1 else "cuda_ipc"
        else:
            transport = "shm" if one_host else "gloo"
    if transport in ("nccl", "cuda_ipc") and not gpu:
        raise ConfigError(f"--weightsync.transport {transport}: needs GPUs; the cluster has none")
    if transport == "shm" and len(set(resources.node_ips)) > 1:
        raise ConfigError(
            "--weightsync.transport shm: needs every process on one host; the cluster spans several"
        )
    if cfg.rollout.backend == "transformers" and transport not in ("gloo", "shm"):
        raise ConfigError(
            f"--rollout.backend transformers receives weights over gloo or shm, not {transport}"
        )
    return Plan(
        device="cuda" if gpu else "cpu",
        groups=groups,
        transport=transport,
        resources=resources,
        num_params=num_params,
    )


def start_ray(cfg: PPOConfig | OfflineConfig) -> tuple[ClusterResources, bool]:
    """Join ``--ray.address`` / ``RAY_ADDRESS``, or start a local cluster on 127.0.0.1 (an already
    initialised Ray in this process is used as it is). Returns the resources and whether this call
    started Ray (so the recipe knows to stop it). For a local cluster, sets
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in ``os.environ`` unless already set (Ray reads it there).
    ``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0`` must be set before Ray is first imported: the ``rlhf`` command
    does it (``rlhf_cli.main``); a Python driver under ``uv run`` sets it itself."""
    import ray

    started = False
    if not ray.is_initialized():
        address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        else:
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            ray.init(
                num_cpus=cfg.ray.num_cpus or os.cpu_count(),
                include_dashboard=False,
                log_to_driver=False,
                _node_ip_address="127.0.0.1",
            )
        started = True
    total = ray.cluster_resources()
    ips = tuple(sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}))
    return ClusterResources(
        cpus=float(total.get("CPU", 0)), gpus=int(total.get("GPU", 0)), nodes=len(ips), node_ips=ips
    ), started


def placement_groups(plan: Plan, *, timeout_s: float, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """One placement group per group (except ``skip``), PACKed (a group's ranks close together);
    waits until every one is placed."""
    import ray
    from ray.util.placement_group import placement_group

    out = {}
    for g in plan.groups:
        if g.name in skip:
            continue
        pg = placement_group(
            [dict(g.bundle) for _ in range(g.processes)], strategy="PACK", name=f"rlhf-{g.name}"
        )
        out[g.name] = pg
    try:
        ray.get([pg.ready() for pg in out.values()], timeout=timeout_s)
    except BaseException:
        from ray.util.placement_group import remove_placement_group

        for pg in out.values():
            remove_placement_group(pg)
        raise
    return out
