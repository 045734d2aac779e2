"""What ``rlhf ppo`` starts: the learner groups (set-up runs in parallel), the rollout engines and the
weight-sync group between the actor and the engines. Each started thing registers its stop with the run
the moment it starts, so a failed start-up is cleaned up by the same path as a finished run."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_cli.config import PPOConfig
from rlhf_cli.config.run import data_parallel_size
from rlhf_cli.ppo.engine_restarts import EngineLauncher, EngineReplacement
from rlhf_cli.runtime.learners.group import LearnerGroup, launch_groups, worker_env
from rlhf_cli.runtime.learners.specs import GroupSpec, group_strategy
from rlhf_cli.runtime.learners.weight_sync import EngineWeightSync
from rlhf_cli.runtime.plan.cluster import PlacementGroups
from rlhf_cli.runtime.plan.placement import GroupPlan, Plan, eager_engines
from rlhf_cli.runtime.runs.checkpoint import zero_partitioned
from rlhf_cli.runtime.runs.failures import Stops, get_all
from rlhf_rollout import EngineClient, create_engines
from rlhf_rollout.backends import EngineSettings, rollout_backend

__all__ = ["Components", "start_components"]


@dataclass(kw_only=True)
class Components:
    tokenizer: Any
    actor: LearnerGroup
    critic: LearnerGroup | None
    ref: LearnerGroup | None
    reward: LearnerGroup | None
    engines: EngineClient
    sync: EngineWeightSync
    teacher: LearnerGroup | None = None
    """On-policy distillation's teacher (the reference group itself when they share a folder)."""

    def scorers(self) -> dict[str, LearnerGroup | None]:
        """The groups the experience stage runs forwards on (``make_experience``'s keywords)."""
        return {"actor": self.actor, "ref": self.ref, "critic": self.critic, "teacher": self.teacher}

    def trained(self) -> dict[str, LearnerGroup | None]:
        """The groups the update stage trains (``update``'s keywords)."""
        return {"actor": self.actor, "critic": self.critic}

    def groups(self) -> dict[str, LearnerGroup]:
        """Every running learner group by role."""
        named = (("actor", self.actor), ("critic", self.critic), ("ref", self.ref), ("reward", self.reward))
        named += (("teacher", self.teacher),) if self.teacher is not self.ref else ()
        return {k: g for k, g in named if g is not None}

    def learner_groups(self) -> dict[str, LearnerGroup]:
        """The groups whose state a checkpoint holds (the trained ones)."""
        return {k: g for k, g in (("actor", self.actor), ("critic", self.critic)) if g is not None}


def _specs(cfg: PPOConfig, plan: Plan, path: str, resume_from: Path | None) -> dict[str, GroupSpec]:
    """One spec per group the plan places (see ``group_strategy`` for the trained groups' stage)."""

    def strategy(lr: float, world: int, *, frozen: bool = False, trained: Any = None, role: str = "") -> Any:
        mb = cfg.train.micro_batch_size
        per_rank = cfg.optimizer_batch_size // data_parallel_size(world, cfg.learner) // mb
        total = cfg.total_optimizer_steps("actor" if trained is cfg.actor else "critic")
        return group_strategy(
            cfg.learner,
            lr=lr,
            micro_batch_size=mb,
            grad_accum_steps=per_rank,
            seed=cfg.train.seed,
            world_size=world,
            frozen=frozen,
            keep_stage=cfg.train.offload_during_rollout or zero_partitioned(resume_from, role),
            lr_schedule=trained.lr_schedule(lr, total) if trained is not None else None,
        )

    a, t = cfg.actor, cfg.rollout.temperature
    specs = {
        "actor": GroupSpec(
            role="actor",
            model_path=path,
            world_size=a.world_size,
            strategy=strategy(a.lr, a.world_size, trained=a, role="actor"),
            model=a.model,
            lora=a.lora,
            temperature=t,
        )
    }
    if plan.group("critic"):
        c, w = cfg.critic, cfg.critic.world_size
        specs["critic"] = GroupSpec(
            role="critic",
            model_path=c.pretrain or path,
            world_size=w,
            strategy=strategy(c.lr, w, trained=c, role="critic"),
            model=c.model,
        )
    frozen = {  # group -> (role, folder, ranks, scores the policy's tokens at its temperature)
        "ref": ("ref", cfg.ref.pretrain or path, cfg.ref.world_size, True),
        "teacher": ("ref", str(cfg.teacher.pretrain), cfg.teacher.world_size, True),  # a scorer, as ref is
        "reward": ("reward", str(cfg.reward.pretrain), cfg.reward.world_size, False),
    }
    for name, (role, folder, w, scores_tokens) in frozen.items():
        if plan.group(name):
            at = {"temperature": t} if scores_tokens else {}
            strategy_ = strategy(a.lr, w, frozen=True)
            specs[name] = GroupSpec(
                role=role, model_path=folder, world_size=w, strategy=strategy_, model=a.model, **at
            )
    return specs


def engine_dtype(cfg: PPOConfig) -> tuple[str, str | None]:
    """The engines' dtype (``PPOConfig.engine_dtype``), and a note when it is not the learners'."""
    learner, chosen = cfg.learner_dtype, cfg.engine_dtype
    if chosen == learner:
        return learner, None
    return chosen, (
        f"--rollout.dtype {chosen} while the learners train in --learner.precision {cfg.learner.precision}: "
        "the engines sample from other log-probs than the learner computes (sync/logp_mismatch_* shows the "
        f"gap; --algo.is_correction weighs it); --rollout.dtype auto keeps them equal"
    )


def engine_settings(cfg: PPOConfig, path: str, *, gpu: bool, params: int) -> EngineSettings:
    """The rollout engines' backend-neutral settings (each backend turns them into its arguments)."""
    return EngineSettings(
        model=path,
        max_model_len=cfg.rollout.max_model_len,
        dtype=engine_dtype(cfg)[0],
        gpu=gpu,
        seed=cfg.train.seed,
        prefix_caching=cfg.vllm.enable_prefix_caching,
        eager=eager_engines(cfg.vllm.enforce_eager, params=params, gpu=gpu),
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        sleep=gpu and cfg.colocates_engines,
        kv_cache_gib=cfg.rollout.kv_cache_gib,
    )


def _engine_launcher(
    cfg: PPOConfig, plan: Plan, pgs: PlacementGroups, path: str, stop_at_exit: Stops, asynchronous: bool
) -> EngineLauncher:
    """How the run starts its engines: on the engines' placement group, each on its bundles and cores."""
    eg = plan.group("engines")
    host = plan.group(eg.share) if eg.share else eg  # colocated: the engines sit on the host's bundles
    env = dict(worker_env())
    if eg.threads:  # CPU: the engine's cores (Ray gives a fractional-CPU actor OMP_NUM_THREADS=1)
        env["OMP_NUM_THREADS"] = str(eg.threads)
    backend = rollout_backend(cfg.rollout.backend)
    settings = engine_settings(cfg, path, gpu=plan.device == "cuda", params=eg.params)
    note = engine_dtype(cfg)[1]
    if note:  # once, at start-up: a mismatch the user asked for
        print(f"warning: {note}", file=sys.stderr)
    env |= backend.process_env(settings)
    create = functools.partial(
        create_engines,
        backend=cfg.rollout.backend,
        engine_kwargs=backend.engine_kwargs(settings),
        tensor_parallel_size=cfg.rollout.tensor_parallel_size,
        placement_group=pgs["engines"],
        num_cpus_per_engine=eg.bundle.get("CPU", 0),
        num_gpus_per_engine=eg.bundle.get("GPU", 0),
        env_vars=env,
        asynchronous=asynchronous and backend.capabilities.asynchronous,
    )
    return EngineLauncher(
        create=create,
        bundles=[pgs.bundle("engines", host.bundle_index(i)) for i in range(eg.processes)],
        cores=_engine_cores(_sharded_cores(eg, cfg, plan), cfg.rollout.num_engines, plan.resources.nodes),
        tp=cfg.rollout.tensor_parallel_size,
        stop_at_exit=stop_at_exit,
    )


def _sharded_cores(eg: GroupPlan, cfg: PPOConfig, plan: Plan) -> tuple[int, ...]:
    """The cores the engines split among them: the plan's pinned ones; unpinned, every core of the node
    for CPU engines sharded over workers (each engine's workers then bind cores no other engine's do)."""
    if eg.cores or eg.threads == 0 or cfg.rollout.tensor_parallel_size == 1:
        return eg.cores
    return tuple(range(int(plan.resources.cpus // max(1, plan.resources.nodes))))


def _engine_cores(cores: tuple[int, ...], engines: int, nodes: int) -> list[list[int]]:
    """Each engine's own slice of its node's engine cores (engines spread evenly over the nodes; none
    when the plan pins nothing)."""
    if not cores:
        return []
    per_node = -(-engines // max(1, nodes))
    share = max(1, len(cores) // per_node)
    return [list(cores[(i % per_node) * share : (i % per_node + 1) * share] or cores) for i in range(engines)]


def start_components(
    cfg: PPOConfig,
    plan: Plan,
    pgs: PlacementGroups,
    model_dir: Path,
    tokenizer: Any,
    *,
    stop_at_exit: Stops,
    engines: EngineClient | None = None,
    asynchronous: bool = False,
    resume_from: Path | None = None,
) -> Components:
    """Start the engines (unless ``engines`` are given) and every learner group at once, wait until all have
    started, then join the weight-sync group. ``asynchronous``: vLLM engines over ``AsyncLLM``, which batch
    concurrent calls and serve pauses and weight updates while generating. ``resume_from``: the
    checkpoint the run resumes (its groups keep the ZeRO stage it was written with)."""
    path = str(model_dir)
    # Everything is created before anything is waited for: each process spends its start-up importing
    # its libraries, and none waits for another's.
    specs = _specs(cfg, plan, path, resume_from)
    launched = replacement = None
    if engines is None:
        launcher = _engine_launcher(cfg, plan, pgs, path, stop_at_exit, asynchronous)
        launched = launcher.launch(range(cfg.rollout.num_engines))
        replacement = EngineReplacement(launcher, limit=cfg.train.max_restarts, timeout_s=cfg.ray.timeout_s)
    groups = launch_groups(specs, plan, pgs, timeout_s=cfg.ray.timeout_s, stop_at_exit=stop_at_exit)
    if launched is not None:
        handles, started = launched
        get_all(started, timeout_s=cfg.ray.timeout_s)  # an engine's death: named
        engines = EngineClient(
            handles,
            tensor_parallel_size=cfg.rollout.tensor_parallel_size,
            timeout_s=cfg.ray.timeout_s,
            replacer=replacement,
            max_replacements=0 if cfg.colocates_engines else cfg.train.max_restarts,  # (shared devices)
        )
    for g in groups.values():
        g.wait_setup()
    sync = EngineWeightSync(
        groups["actor"],
        engines,
        transport=plan.transport,
        timeout_s=cfg.weightsync.timeout_s,
        lock=replacement.lock if replacement is not None else None,
        with_frozen_tower=cfg.engines_drop_weights,
    )
    if replacement is not None:
        replacement.sync = sync
    stop_at_exit(sync.close_quietly)
    print(sync.description, file=sys.stderr)  # the transport `auto` resolved to, e.g. gloo across hosts
    return Components(
        tokenizer=tokenizer,
        actor=groups["actor"],
        critic=groups.get("critic"),
        ref=groups.get("ref"),
        reward=groups.get("reward"),
        engines=engines,
        sync=sync,
        teacher=groups.get("ref") if cfg.teacher_is_reference else groups.get("teacher"),
    )
