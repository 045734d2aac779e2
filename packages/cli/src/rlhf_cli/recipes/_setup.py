"""Set-up pieces of the PPO recipe: start the groups and engines together, load the prompts, the
built-in warm-up, and evaluation."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rlhf_learner import StrategyOptions
from rlhf_rollout import AgentExecutorBase, EngineClient, SamplingParams, create_engines

from rlhf_cli import task
from rlhf_cli.batches import Sample, sft_batch
from rlhf_cli.config import PPOConfig
from rlhf_cli.data import PromptSet, encode_prompt, load_records
from rlhf_cli.groups import GroupSpec, LearnerGroup, launch_groups, worker_env
from rlhf_cli.placement import Plan
from rlhf_cli.updates import micro_batches
from rlhf_cli.weights import EngineWeightSync

__all__ = ["Components", "evaluate", "load_prompts", "start_components", "warmup"]

WORKER_EXTENSION = {
    "vllm": "rlhf_weightsync.vllm_ext.WeightSyncWorkerExtension",
    "transformers": "rlhf_weightsync.module_ext.ModuleWeightSyncExtension",
}
"""The weight-sync worker extension each rollout backend mixes into its workers."""


@dataclass(kw_only=True)
class Components:
    tokenizer: Any
    actor: LearnerGroup
    critic: LearnerGroup | None
    ref: LearnerGroup | None
    reward: LearnerGroup | None
    engines: EngineClient
    sync: EngineWeightSync

    def learner_groups(self) -> dict[str, LearnerGroup]:
        """The groups whose state a checkpoint holds (the trained ones)."""
        return {k: g for k, g in (("actor", self.actor), ("critic", self.critic)) if g is not None}

    owns_engines: bool = True
    placement_groups: dict[str, Any] | None = None

    def shutdown(self) -> None:
        """Leave the sync group, stop the groups (and the engines this run started), free the bundles."""
        import ray
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):
            self.sync.close()
        for g in (self.actor, self.critic, self.ref, self.reward):
            if g is not None:
                g.shutdown()
        if self.owns_engines:
            for e in self.engines.engines:
                with contextlib.suppress(Exception):
                    ray.get(e.shutdown.remote(), timeout=60)
                ray.kill(e, no_restart=True)
        for pg in (self.placement_groups or {}).values():
            remove_placement_group(pg)


def _strategy(cfg: PPOConfig, *, lr: float, world: int, frozen: bool = False) -> StrategyOptions:
    """A group's DeepSpeed options: ``--ds`` plus what the group sets. A frozen model (reference,
    reward) has no optimizer or gradients to shard, so ZeRO-1/2 mean plain replicas (stage 0) for it;
    ZeRO-3 still shards its parameters."""
    options = replace(
        cfg.ds,
        lr=lr,
        micro_batch_size=cfg.train.micro_batch_size,
        grad_accum_steps=max(1, cfg.samples_per_step // world // cfg.train.micro_batch_size),
        seed=cfg.train.seed,
    )
    if frozen and options.zero_stage in (1, 2):
        options = replace(options, zero_stage=0, offload_optimizer=False)
    return options


def _engine_kwargs(cfg: PPOConfig, path: str, *, gpu: bool) -> dict[str, Any]:
    """Constructor arguments of one rollout engine of the configured backend."""
    common = dict(
        model=path,
        max_model_len=cfg.vllm.max_model_len,
        worker_extension_cls=WORKER_EXTENSION[cfg.rollout.backend],
    )
    if cfg.rollout.backend == "transformers":
        return {**common, "dtype": "float32", "device": "cuda" if gpu else "cpu"}
    out = {
        **common,
        "dtype": "auto" if gpu else "float32",
        "seed": cfg.train.seed,
        "enable_prefix_caching": cfg.vllm.enable_prefix_caching,
    }
    if gpu:
        out["gpu_memory_utilization"] = cfg.vllm.gpu_memory_utilization
    return out


def start_components(
    cfg: PPOConfig,
    plan: Plan,
    pgs: dict[str, Any],
    model_dir: Path,
    tokenizer: Any,
    *,
    engines: EngineClient | None = None,
) -> Components:
    """Start every learner group (set-up runs in parallel), then the engines, then join the sync group."""
    gpu = plan.device == "cuda"
    env = worker_env()
    path = str(model_dir)
    specs: dict[str, GroupSpec] = {
        "actor": GroupSpec(
            role="actor",
            model_path=path,
            world_size=cfg.actor.world_size,
            strategy=_strategy(cfg, lr=cfg.actor.lr, world=cfg.actor.world_size),
            model=cfg.actor.model,
            lora=cfg.actor.lora,
            temperature=cfg.rollout.temperature,
        ),
    }
    if plan.group("critic"):
        specs["critic"] = GroupSpec(
            role="critic",
            model_path=cfg.critic.pretrain or path,
            world_size=cfg.critic.world_size,
            strategy=_strategy(cfg, lr=cfg.critic.lr, world=cfg.critic.world_size),
            model=cfg.critic.model,
        )
    if plan.group("ref"):
        specs["ref"] = GroupSpec(
            role="ref",
            model_path=cfg.ref.pretrain or path,
            world_size=cfg.ref.world_size,
            strategy=_strategy(cfg, lr=cfg.actor.lr, world=cfg.ref.world_size, frozen=True),
            model=cfg.actor.model,
            temperature=cfg.rollout.temperature,
        )
    if plan.group("reward"):
        specs["reward"] = GroupSpec(
            role="reward",
            model_path=str(cfg.reward.pretrain),
            world_size=cfg.reward.world_size,
            strategy=_strategy(cfg, lr=cfg.actor.lr, world=cfg.reward.world_size, frozen=True),
            model=cfg.actor.model,
        )
    owns = engines is None
    try:
        groups = launch_groups(specs, plan, pgs, timeout_s=cfg.ray.timeout_s)
    except BaseException:
        _abandon({}, None, pgs)
        raise
    eg = plan.group("engines")
    kwargs, engine_env = _engine_kwargs(cfg, path, gpu=gpu), dict(env)
    if cfg.rollout.backend == "vllm":
        engine_env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm.kv_cache_gib)
        engine_env.setdefault(
            "VLLM_CPU_NUM_OF_RESERVED_CPU", os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        )
    try:
        if engines is None:
            handles = create_engines(
                num_engines=cfg.vllm.num_engines,
                backend=cfg.rollout.backend,
                engine_kwargs=kwargs,
                tensor_parallel_size=cfg.vllm.tensor_parallel_size,
                placement_group=pgs["engines"],
                num_cpus_per_engine=eg.bundle.get("CPU", 0),
                num_gpus_per_engine=eg.bundle.get("GPU", 0),
                env_vars=engine_env,
                start_timeout_s=cfg.ray.timeout_s,
            )
            engines = EngineClient(
                handles, tensor_parallel_size=cfg.vllm.tensor_parallel_size, timeout_s=cfg.ray.timeout_s
            )
        for g in groups.values():
            g.wait_setup()
        sync = EngineWeightSync(
            groups["actor"], engines, transport=plan.transport, timeout_s=cfg.weightsync.timeout_s
        )
    except BaseException:
        _abandon(groups, engines if owns else None, pgs)
        raise
    return Components(
        tokenizer=tokenizer,
        actor=groups["actor"],
        critic=groups.get("critic"),
        ref=groups.get("ref"),
        reward=groups.get("reward"),
        engines=engines,
        sync=sync,
        owns_engines=owns,
        placement_groups=pgs,
    )


def _abandon(groups: dict[str, LearnerGroup], engines: EngineClient | None, pgs: dict[str, Any]) -> None:
    """Stop what a failed start-up had started."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for g in groups.values():
        g.shutdown()
    for e in engines.engines if engines is not None else []:
        ray.kill(e, no_restart=True)
    for pg in pgs.values():
        remove_placement_group(pg)


def load_prompts(cfg: PPOConfig, tokenizer: Any) -> tuple[PromptSet, PromptSet | None]:
    """Training prompts and evaluation prompts (None when there are none to evaluate on)."""
    limit = cfg.vllm.max_model_len
    if cfg.data.path is None:
        train = task.records(seed=cfg.train.seed)
        evals = task.records(seed=cfg.train.seed + 1) if cfg.eval.path is None else None
        source = f"built-in task {task.TASK_NAME}"
    else:
        train = load_records(
            cfg.data.path,
            input_key=cfg.data.input_key,
            label_key=cfg.data.label_key,
            max_samples=cfg.data.max_samples,
        )
        evals, source = None, str(cfg.data.path)
    if cfg.eval.path is not None:
        evals = load_records(
            cfg.eval.path,
            input_key=cfg.data.input_key,
            label_key=cfg.data.label_key,
            max_samples=cfg.eval.max_samples,
            flag="--eval.path",
        )
    chat = cfg.data.apply_chat_template
    train_set = PromptSet.from_records(
        train, tokenizer, apply_chat_template=chat, seed=cfg.train.seed, max_prompt_len=limit, source=source
    )
    eval_set = None
    if evals:
        evals = evals[: cfg.eval.max_samples] if cfg.eval.max_samples else evals
        eval_set = PromptSet.from_records(
            evals,
            tokenizer,
            apply_chat_template=chat,
            seed=cfg.train.seed,
            max_prompt_len=limit,
            source="evaluation prompts",
        )
    return train_set, eval_set


def evaluate(
    cfg: PPOConfig,
    make_executor: Callable[[SamplingParams], AgentExecutorBase],
    prompts: PromptSet,
    reward_model: LearnerGroup | None,
) -> dict[str, float]:
    """Greedy answers to every evaluation prompt: mean reward and pass rate (score >= threshold)."""
    params = SamplingParams(temperature=0.0, n=1, max_new_tokens=cfg.rollout.max_new_tokens)
    trajs = make_executor(params).run(prompts.token_ids, labels=prompts.labels)
    scores = [t.score for t in trajs]
    if reward_model is not None:
        scores = [
            float(s)
            for s in reward_model.forward(
                [torch.tensor(t.token_ids) for t in trajs],
                micro_batch_size=cfg.train.micro_batch_size,
                packing=False,
            )
        ]
    return {
        "eval/reward_mean": sum(scores) / len(scores),
        "eval/pass_rate": sum(s >= cfg.eval.pass_threshold for s in scores) / len(scores),
    }


def warmup(cfg: PPOConfig, c: Components) -> None:
    """Built-in demo: a few supervised steps on the answer format before reinforcement learning."""
    pairs = task.warmup_records(seed=cfg.train.seed)
    eos = c.tokenizer.eos_token_id
    samples = []
    for prompt, response in pairs:
        p = encode_prompt(prompt, c.tokenizer, apply_chat_template=cfg.data.apply_chat_template)
        r = c.tokenizer(response, add_special_tokens=False)["input_ids"] + [eos]
        ids = torch.tensor(p + r)
        mask = torch.tensor([False] * len(p) + [True] * len(r))
        samples.append(
            Sample(
                token_ids=ids,
                action_mask=mask,
                rollout_logp=torch.zeros(len(ids)),
                score=0.0,
                reward=0.0,
                truncated=False,
                prompt_index=0,
                weight_version=0,
            )
        )
    per_step = cfg.samples_per_step
    g = torch.Generator().manual_seed(cfg.train.seed)
    for _ in range(cfg.train.warmup_sft_steps):
        idx = torch.randint(len(samples), (per_step,), generator=g).tolist()
        batches = micro_batches(
            [samples[i] for i in idx],
            c.actor,
            micro_batch_size=cfg.train.micro_batch_size,
            dynamic=False,
            build=lambda part: sft_batch(part, packing=cfg.train.packing),
        )
        c.actor.train_sft(batches)
