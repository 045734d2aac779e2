"""Ray: which group gets which bundles, and the device memory each process needs. Pure data from the
configuration, the cluster's resources and each group's model (``model_sizes``): ``--dry-run`` prints
it without starting anything, and a plan that cannot fit (CPUs, GPUs, GPU memory) fails before start-up."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlhf_learner import StrategyOptions
from rlhf_learner.strategy import training_backend
from rlhf_rollout.backends import MemoryQuery, rollout_backend

from rlhf_cli.config import ConfigError, OfflineConfig, PPOConfig
from rlhf_cli.config.run import RayConfig
from rlhf_cli.runtime.host.cpu_threads import check_engine_workers, engine_threads, pinned, with_threads
from rlhf_cli.runtime.plan.cluster import check_host_memory
from rlhf_cli.runtime.plan.colocation import colocate, colocation_lines
from rlhf_cli.runtime.plan.model_sizes import (
    ModelShape,
    ModelSizes,
    activation_bytes,
    check_positions,
    check_top_k,
    model_sizes,
)
from rlhf_cli.runtime.plan.types import ClusterResources, GroupPlan, Plan, parts_note

__all__ = ["EAGER_BELOW_PARAMS", "GroupPlan", "Plan", "eager_engines", "make_offline_plan", "make_plan"]

_GIB = 2**30


@dataclass(frozen=True)
class _Learner:
    """One learner group to plan: its name, ranks, whether it trains, and its gradient checkpointing."""

    name: str
    world: int
    trains: bool
    checkpointing: bool = False
    gc_flag: str = ""
    note: str = ""
    lora: bool = False
    nodes: int = 1


def _learner_group(
    g: _Learner,
    shape: ModelShape,
    ds: StrategyOptions,
    bundle: dict,
    load: tuple[int, int] | None,
    keep_stage: bool = False,
) -> GroupPlan:
    """A learner group's plan. Per process: weights (2 bytes in bf16, else 4) and, when it trains, fp32
    gradients and Adam states (fp32 master + two moments: 12 bytes in bf16; the moments: 8 in fp32),
    divided over the ranks as the ZeRO stage shards them (none on the device when offloaded; with LoRA
    only the adapters train: their few parameters are not counted); on GPU (``load``: sequence length,
    rows) plus ``activation_bytes`` of one micro-batch."""
    trained = ds if keep_stage else ds.for_ranks(g.world)  # as ``group_strategy`` gives it
    ds = trained if g.trains else ds.for_inference()
    bf16, n = ds.precision == "bf16", shape.params
    backend = training_backend(ds.backend)
    stage = backend.sharding_stage(ds, train=g.trains)
    shard = lambda b, on: b / g.world if stage >= on else b  # noqa: E731
    parts = {"weights": 0.0 if ds.offload_params else shard(n * (2 if bf16 else 4), 3) / _GIB}
    flags = ("--learner.zero_stage 3", "--train.micro_batch_size")
    if g.trains:
        trained = 0 if g.lora else n
        adam = 0.0 if ds.offload_optimizer else shard(trained * (12 if bf16 else 8), 1)
        parts["grads+optimizer"] = (shard(trained * 4, 2) + adam) / _GIB
        flags = ("--learner.zero_stage", "--learner.offload_optimizer", "--train.micro_batch_size")
        flags += () if g.checkpointing else (g.gc_flag,)
    if load is not None:
        act = activation_bytes(shape, *load, trains=g.trains, checkpointing=g.checkpointing, bits16=bf16)
        parts["activations"] = act / _GIB
    trains = f"{backend.describe(ds)}, trains" + (" LoRA adapters" if g.lora else "")
    note = g.note or (trains if g.trains else "frozen")
    return GroupPlan(
        name=g.name,
        processes=g.world,
        bundle=bundle,
        parts=parts,
        params=n,
        note=note,
        flags=flags,
        nodes=g.nodes,
    )


EAGER_BELOW_PARAMS = 1_000_000
"""With ``--vllm.enforce_eager`` unset, CPU engines run a policy smaller than this eagerly."""


def eager_engines(flag: bool | None, *, params: int, gpu: bool) -> bool:
    """Whether vLLM engines skip torch.compile: ``flag`` (``--vllm.enforce_eager``), else on CPU for a policy
    under :data:`EAGER_BELOW_PARAMS` parameters, whose compile costs more start-up than it saves (the
    figures: docs/performance.md)."""
    if flag is not None:
        return flag
    return not gpu and params < EAGER_BELOW_PARAMS


def _engines_group(cfg: PPOConfig, shape: ModelShape, bundle: dict, resources: ClusterResources) -> GroupPlan:
    """Engine processes: weights and KV cache as the rollout backend estimates them (``memory``); a KV
    cache pre-allocated in host memory must fit the node, one on a GPU must hold one
    ``--rollout.max_model_len`` sequence."""
    tp, util, max_len = (
        cfg.rollout.tensor_parallel_size,
        cfg.rollout.gpu_memory_utilization,
        cfg.rollout.max_model_len,
    )
    backend = rollout_backend(cfg.rollout.backend)
    mem = backend.memory(
        MemoryQuery(
            params=shape.params,
            layers=shape.layers,
            kv_dim=shape.kv_dim,
            tensor_parallel_size=tp,
            gpu=resources.gpus > 0,
            device_gib=resources.gpu_memory_gib,
            gpu_memory_utilization=util,
            max_model_len=max_len,
            kv_cache_gib=cfg.rollout.kv_cache_gib,
            dtype_bytes=2 if cfg.engine_dtype == "bfloat16" else 4,
        )
    )
    parts = {"weights": mem.weights_gib} | ({"KV": mem.kv_gib} if mem.kv_gib is not None else {})
    if mem.kv_on_host and mem.kv_gib is not None:  # here, not in each engine's start-up
        procs = cfg.rollout.num_engines * tp
        what, flag = "engine process(es)", "--rollout.kv_cache_gib"
        check_host_memory(resources, gib=mem.kv_gib, processes=procs, what=what, flag=flag)
    if mem.min_kv_gib is not None and mem.kv_gib is not None and mem.kv_gib < mem.min_kv_gib:
        raise ConfigError(
            f"engines: {mem.weights_gib:.2f} GiB of weights per process leave {max(mem.kv_gib, 0):.2f} GiB of KV "
            f"cache in --rollout.gpu_memory_utilization {util:g} x {resources.gpu_memory_gib:.2f} GiB, less than one "
            f"--rollout.max_model_len {max_len} sequence; raise --rollout.gpu_memory_utilization or "
            "--rollout.tensor_parallel_size"
        )
    extra = f", {mem.note}" if mem.note else ("" if mem.kv_gib is not None else ", KV: grows with the batch")
    if backend.capabilities.compiles:
        eager = eager_engines(cfg.vllm.enforce_eager, params=shape.params, gpu=resources.gpus > 0)
        extra += ", eager" if eager else ", compiled"
    note = f"{cfg.rollout.num_engines} x {cfg.rollout.backend} engine(s), TP {tp}{extra}"
    flags = ("--rollout.gpu_memory_utilization", "--rollout.tensor_parallel_size")
    procs, bundle, n = cfg.rollout.num_engines * tp, dict(bundle), shape.params
    threads = 0 if resources.gpus else engine_threads(procs, resources, cfg.ray.threads_per_rank, n)
    return GroupPlan(
        name="engines",
        processes=procs,
        bundle=bundle,
        parts=parts,
        params=n,
        note=note,
        flags=flags,
        threads=threads,
    )


def _check_memory(groups: list[GroupPlan], resources: ClusterResources, ray_cfg: RayConfig) -> None:
    """On GPU of known size, the processes sharing a GPU (``--ray.gpus_per_worker`` < 1) add up: packed in
    the plan's order, floor(1 / gpus_per_worker) per GPU, as the placement groups are created in that
    order and each packs its bundles (groups spanning nodes are placed first: an estimate for them).
    ConfigError for the first GPU whose processes do not fit."""
    device = resources.gpu_memory_gib
    if resources.gpus == 0 or device is None:
        return
    per_gpu = max(1, math.floor(1 / ray_cfg.gpus_per_worker + 1e-9))
    procs = [g for g in groups for _ in range(g.processes)]
    for share in (procs[i : i + per_gpu] for i in range(0, len(procs), per_gpu)):
        need = sum(g.memory_gib for g in share)
        if need <= device:
            continue
        first = {g.name: g for g in share}  # one GroupPlan per group, in the order they appear
        who = " + ".join(
            f"{sum(g is p for p in share)} x {n} ({parts_note(g.parts)})" for n, g in first.items()
        )
        flags = list(dict.fromkeys(f for g in share for f in g.flags))
        flags += ["--ray.gpus_per_worker"] if len(share) > 1 else []
        raise ConfigError(
            f"GPU memory: {who} on one GPU need {need:.2f} GiB, the device has {device:.2f} GiB; "
            f"lower it with {', '.join(flags)}"
        )


def _bundle(resources: ClusterResources, ray_cfg: RayConfig) -> dict[str, float]:
    if resources.gpus > 0:
        return {"GPU": ray_cfg.gpus_per_worker, "CPU": 1.0}
    return {"CPU": ray_cfg.cpus_per_worker}


def _check_fits(groups: list[GroupPlan], resources: ClusterResources, ray_cfg: RayConfig, what: str) -> None:
    """ConfigError naming the flags when the groups need more nodes, CPUs, GPUs or GPU memory than there is."""
    for g in groups:
        if g.nodes > resources.nodes:
            raise ConfigError(
                f"--{g.name}.num_nodes {g.nodes}: the group spans {g.nodes} nodes, the cluster has {resources.nodes}"
                f" (join a cluster of {g.nodes} with --ray.address, lower it, or shrink it with --train.elastic)"
            )
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
    _check_memory(groups, resources, ray_cfg)


def _weight_sync_transport(cfg: PPOConfig, resources: ClusterResources) -> tuple[str, str]:
    """The transport ``--weightsync.transport`` resolves to on this placement, and why it fits."""
    from rlhf_weightsync import select_transport

    one_host = len(set(resources.node_ips)) <= 1
    receivers = rollout_backend(cfg.rollout.backend).capabilities.gpu_weight_transports
    with_actor = any({"actor", "engines"} <= set(s) for s in cfg.colocated)
    share = min(cfg.ray.gpus_per_worker, 0.5) if with_actor else cfg.ray.gpus_per_worker
    try:
        transport = select_transport(
            cfg.weightsync.transport,
            gpu=resources.gpus > 0,
            one_host=one_host,
            gpu_receivers=receivers,
            gpus_per_worker=share,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return transport, gpu_transport_reason(transport, with_actor=with_actor, share=share, gpus=resources.gpus)


def gpu_transport_reason(transport: str, *, with_actor: bool, share: float, gpus: int) -> str:
    """Why a GPU transport fits this placement, or a one-line ConfigError when nothing guarantees it:
    CUDA IPC needs every engine on actor rank 0's GPU (colocated with the actor, or one GPU in all), NCCL a
    GPU per process (``--ray.gpus_per_worker 1``). Empty for the host-memory transports."""
    if transport == "cuda_ipc":
        if with_actor or gpus == 1:
            return (
                "the engines share actor rank 0's GPU" if with_actor else "every process shares the one GPU"
            )
        raise ConfigError(
            f"weight sync over cuda_ipc (--ray.gpus_per_worker {share:g}: processes share GPUs): nothing puts "
            f"every engine on actor rank 0's GPU among the cluster's {gpus}; colocate them with the actor "
            "(--train.colocate_all) or give each process a whole GPU (--ray.gpus_per_worker 1: NCCL)"
        )
    if transport == "nccl":
        if share >= 1:
            return "each process has a GPU of its own"
        raise ConfigError(
            f"weight sync over nccl with --ray.gpus_per_worker {share:g}: NCCL needs a GPU per process "
            "(processes sharing one cannot join a group); use cuda_ipc with engines colocated with the actor, "
            "or --ray.gpus_per_worker 1"
        )
    return ""


def _plan(
    groups: list[GroupPlan], resources: ClusterResources, transport: str, n: int, *, reason: str = ""
) -> Plan:
    gpu, dev = resources.gpus > 0, resources.gpu_memory_gib
    notes = [f"device memory: {dev:.2f} GiB per GPU (processes sharing a GPU add up)"] if gpu and dev else []
    device = "cuda" if gpu else "cpu"
    return Plan(
        device=device,
        groups=groups,
        transport=transport,
        transport_reason=reason,
        resources=resources,
        num_params=n,
        notes=notes,
    )


def make_offline_plan(
    cfg: OfflineConfig,
    resources: ClusterResources,
    *,
    with_ref: bool,
    sizes: ModelSizes | None = None,
) -> Plan:
    """The trained group (``model``) and, with ``with_ref``, the command's frozen group (``ref`` for dpo
    and kto, ``teacher`` for distill: ``cfg.frozen_group``); ``sizes`` as in ``make_plan``. On GPU a
    micro-batch is ``--train.micro_batch_size`` examples (two sequences each for rm, dpo and kto) of
    ``--data.max_len`` tokens."""
    sizes = sizes if sizes is not None else model_sizes(cfg)
    frozen = cfg.frozen_group if with_ref else None
    models = {"model": sizes.actor, "reference": getattr(sizes, frozen) if frozen else None}
    check_positions(cfg.data.max_len, "--data.max_len", models)  # type: ignore[attr-defined]
    check_top_k(getattr(getattr(cfg, "algo", None), "top_k", None), sizes)
    _check_4bit(getattr(cfg, "lora", None), "--lora.load_in_4bit", resources)
    gc = cfg.model.options.gradient_checkpointing
    gc_flag, lora = "--model.options.gradient_checkpointing", getattr(cfg, "lora", None) is not None
    specs = [_Learner("model", cfg.model.world_size, True, gc, gc_flag, lora=lora, nodes=cfg.model.num_nodes)]
    if frozen is not None:
        group = cfg.frozen
        note = "frozen, stopped after precomputing" if group.precompute else "frozen"
        specs.append(_Learner(frozen, group.world_size, False, note=note, nodes=group.num_nodes))
    rows = cfg.train.micro_batch_size * (2 if cfg.command in ("rm", "dpo", "kto") else 1)
    load = (cfg.data.max_len, rows) if resources.gpus > 0 else None  # type: ignore[attr-defined]
    bundle = _bundle(resources, cfg.ray)
    groups = [_learner_group(s, sizes.of(s.name), cfg.learner, bundle, load) for s in specs]
    shapes = {"model": cfg.model, frozen: cfg.frozen}
    per_node = {g.name: shapes[g.name].num_devices_per_node for g in groups}
    groups = with_threads(groups, per_node, resources, cfg.ray.threads_per_rank)
    _check_fits(groups, resources, cfg.ray, "the learner groups")
    plan = _plan(groups, resources, "none", sizes.actor.params)
    plan.notes.append(cfg.ckpt.plan_note())
    return plan


def _check_4bit(lora: Any, flag: str, resources: ClusterResources) -> None:
    """QLoRA's 4-bit base weights (bitsandbytes) need CUDA GPUs."""
    if lora is not None and lora.load_in_4bit and resources.gpus == 0:
        raise ConfigError(
            f"{flag}: 4-bit base weights (QLoRA, bitsandbytes) need CUDA GPUs; the cluster has none"
        )


def _ppo_learners(cfg: PPOConfig) -> list[_Learner]:
    """actor, and critic / ref / teacher / reward when the run uses them."""
    out = []
    for name, group, used in (("actor", cfg.actor, True), ("critic", cfg.critic, cfg.uses_critic)):
        gc, gc_flag = group.model.gradient_checkpointing, f"--{name}.model.gradient_checkpointing"
        lora = getattr(group, "lora", None) is not None  # the actor's --actor.lora
        shape = _Learner(name, group.world_size, True, gc, gc_flag, lora=lora, nodes=group.num_nodes)
        out += [shape] if used else []
    if cfg.uses_reference:
        note = "frozen; the teacher too" if cfg.teacher_is_reference else "frozen"
        out.append(_Learner("ref", cfg.ref.world_size, False, note=note, nodes=cfg.ref.num_nodes))
    if cfg.distills and not cfg.teacher_is_reference:
        note = "frozen teacher"
        out.append(_Learner("teacher", cfg.teacher.world_size, False, note=note, nodes=cfg.teacher.num_nodes))
    if cfg.reward.source == "model":
        note = "frozen reward model"
        out.append(_Learner("reward", cfg.reward.world_size, False, note=note, nodes=cfg.reward.num_nodes))
    return out


def make_plan(cfg: PPOConfig, resources: ClusterResources, *, sizes: ModelSizes | None = None) -> Plan:
    """Processes, bundles and memory per group; raises ConfigError naming the flags when it cannot fit.
    ``sizes``: each group's model (``model_sizes(cfg, model_dir)``; unset: read from ``cfg``'s folders).
    On GPU a learner micro-batch is ``--train.micro_batch_size`` sequences of ``--rollout.max_model_len``
    tokens (prompt + response)."""
    sizes = sizes if sizes is not None else model_sizes(cfg)
    models = {
        "policy": sizes.actor,
        "critic": sizes.critic,
        "reference": sizes.ref,
        "reward model": sizes.reward,
        "teacher": sizes.teacher,
    }
    check_positions(cfg.rollout.max_model_len, "--rollout.max_model_len", models)
    _check_4bit(cfg.actor.lora, "--actor.lora.load_in_4bit", resources)
    dense = cfg.algo.distill.top_k if cfg.distills else None
    check_top_k(dense, sizes, "--algo.distill.top_k", sequence_parallel=cfg.learner.sequence_parallel_size)
    gpu, per = resources.gpus > 0, _bundle(resources, cfg.ray)
    load = (cfg.rollout.max_model_len, cfg.train.micro_batch_size) if gpu else None
    keep = cfg.train.offload_during_rollout
    groups = [_learner_group(s, sizes.of(s.name), cfg.learner, per, load, keep) for s in _ppo_learners(cfg)]
    shapes = {
        "actor": cfg.actor,
        "critic": cfg.critic,
        "ref": cfg.ref,
        "teacher": cfg.teacher,
        "reward": cfg.reward,
    }
    per_node = {g.name: shapes[g.name].num_devices_per_node for g in groups}
    groups = with_threads(groups, per_node, resources, cfg.ray.threads_per_rank)
    groups.append(_engines_group(cfg, sizes.of("engines"), per, resources))
    if cfg.pins_cores:
        per_node["engines"] = math.ceil(
            cfg.rollout.num_engines * cfg.rollout.tensor_parallel_size / resources.nodes
        )
        # Asynchronous: the producer's reference forward overlaps both sides; bound to no core (with a
        # half's threads: one on 2 cores) it takes what either side leaves idle, faster than on either
        # side's cores (docs/performance.md).
        floating = ("ref",) if cfg.train.async_.enabled else ()
        groups = pinned(groups, per_node, resources, floating=floating)
    groups = colocate(groups, cfg.colocated)
    n, tp = cfg.rollout.num_engines, cfg.rollout.tensor_parallel_size
    check_engine_workers(groups, resources, tp=tp, engines=n)
    engines = f"--rollout.num_engines {n} x --rollout.tensor_parallel_size {tp} engine process(es)"
    _check_fits(groups, resources, cfg.ray, f"{engines} and the learner groups")
    transport, why = _weight_sync_transport(cfg, resources)
    plan = _plan(groups, resources, transport, sizes.actor.params, reason=why)
    plan.notes.extend(colocation_lines(groups, resources.gpu_memory_gib if gpu else None, engines=n * tp))
    plan.notes.append(cfg.ckpt.plan_note())
    return plan
