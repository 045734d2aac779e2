"""``rlhf ppo``: set-up (data, Ray, learner groups, engines, weight sync) -> train (rollout ->
experience -> updates -> sync -> log -> checkpoint, each step) -> clean-up (export, summary, stop)."""

from __future__ import annotations

import functools
import os
import queue
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlhf_algos import AdaptiveKLController, FixedKLController
from rlhf_rollout import EngineClient
from transformers import AutoTokenizer

from rlhf_cli import task
from rlhf_cli.checkpoint import (
    RESUMABLE_CHANGES,
    RunState,
    check_resumable,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rlhf_cli.config import PPOConfig, dump_yaml
from rlhf_cli.data import PromptCursor
from rlhf_cli.experience import make_experience
from rlhf_cli.placement import Plan, count_params, local_resources, make_plan, placement_groups, start_ray
from rlhf_cli.recipes._session import run_session
from rlhf_cli.recipes._setup import evaluate, load_prompts, start_components, warmup
from rlhf_cli.rollout_stage import RolloutBatch, RolloutStage
from rlhf_cli.sources import executor_factory
from rlhf_cli.tracking import Tracker
from rlhf_cli.updates import update_critic, update_policy

__all__ = ["PPOResult", "plan", "run"]


@dataclass(frozen=True, kw_only=True)
class PPOResult:
    run_dir: Path
    final_model: Path
    history: list[dict]
    summary: str


def resolve_model(cfg: PPOConfig) -> Path:
    """The actor's folder: ``--actor.pretrain``, or the built-in demo model (built once, offline)."""
    if cfg.actor.pretrain is not None:
        from rlhf_learner.models import check_model_dir

        check_model_dir(cfg.actor.pretrain)
        return Path(cfg.actor.pretrain)
    return task.build_demo_model(Path(cfg.logger.run_dir) / "base_model")


def plan(cfg: PPOConfig, *, connect: bool = False) -> Plan:
    """The placement plan (``--dry-run``): local resources, or the cluster's when ``connect``."""
    from rlhf_cli.placement import local_resources

    resources = start_ray(cfg)[0] if connect else local_resources(cfg)
    model = Path(cfg.actor.pretrain) if cfg.actor.pretrain else None
    if model is not None:
        from rlhf_learner.models import check_model_dir

        check_model_dir(model)
        n = count_params(model)
    else:
        n = task.demo_num_params()
    return make_plan(cfg, resources, num_params=n)


def run(cfg: PPOConfig, *, engines: EngineClient | None = None) -> PPOResult:
    """Train. ``engines``: running rollout engines to use instead of starting ``--vllm.num_engines``
    new ones (several runs in one process, e.g. tests); the run syncs its own weights into them first."""
    # ---- set-up -------------------------------------------------------------------------------
    run_dir = Path(cfg.logger.run_dir)
    ckpt_root = run_dir / "checkpoints"
    found = latest_checkpoint(ckpt_root) if cfg.ckpt.load_enable else None
    if found is not None:
        check_resumable(found, cfg.model_dump(mode="json"), resumable=(*RESUMABLE_CHANGES, "eval.path"))
    elif cfg.ckpt.load_enable:
        print(f"--ckpt.load_enable: no checkpoint in {ckpt_root}; starting from step 0", file=sys.stderr)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    model_dir = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    train_set, eval_set = load_prompts(cfg, tokenizer)
    executors = executor_factory(cfg, tokenizer=tokenizer)  # loads reward / agent files: fail before start-up
    num_params = count_params(model_dir)
    if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
        make_plan(
            cfg, local_resources(cfg), num_params=num_params
        )  # a plan that cannot fit fails before start-up
    with run_session(cfg) as session:
        layout = make_plan(cfg, session.resources, num_params=num_params)
        pgs = placement_groups(layout, timeout_s=cfg.ray.timeout_s, skip=("engines",) if engines else ())
        c = start_components(cfg, layout, pgs, model_dir, tokenizer, engines=engines)
        session.stop_at_exit(c.shutdown)
        make_executor = functools.partial(executors, c.engines)
        state = RunState(cursor=PromptCursor(), kl_coef=cfg.algo.kl.coef)
        if found is not None:
            state = load_checkpoint(found, c.learner_groups())
        elif cfg.warmup_runs:
            warmup(cfg, c)
        train_set.cursor = state.cursor
        kl_ctl = (
            AdaptiveKLController(value=state.kl_coef, target=cfg.algo.kl.target, horizon=cfg.algo.kl.horizon)
            if cfg.algo.kl.target is not None
            else FixedKLController(value=state.kl_coef)
        )
        c.sync.push(version=state.weight_version or 1)  # a resumed run re-sends the version it had
        rollout = RolloutStage(cfg, make_executor=make_executor, prompts=train_set, reward_model=c.reward)
        tracker = session.tracker = Tracker(
            run_dir,
            tensorboard=cfg.logger.tensorboard,
            wandb_project=cfg.logger.wandb_project,
            progress=cfg.logger.progress,
            total_steps=cfg.train.num_steps,
            config=cfg.model_dump(mode="json"),
            resume_step=state.step,
        )
        handoff: queue.Queue[RolloutBatch] = queue.Queue(maxsize=1)  # generation -> training

        # ---- train ------------------------------------------------------------------------------
        for step in range(state.step + 1, cfg.train.num_steps + 1):
            t_step = time.perf_counter()
            metrics: dict[str, float] = {}
            if eval_set is not None and cfg.eval.every and (step == 1 or (step - 1) % cfg.eval.every == 0):
                metrics |= evaluate(cfg, make_executor, eval_set, c.reward)
            handoff.put(rollout.produce(step, weight_version=c.sync.version), timeout=cfg.ray.timeout_s)
            batch = handoff.get(timeout=cfg.ray.timeout_s)
            metrics |= batch.metrics
            metrics |= make_experience(
                cfg, batch.samples, actor=c.actor, ref=c.ref, critic=c.critic, kl_coef=kl_ctl.value
            )
            t0 = time.perf_counter()
            for _ in range(cfg.train.ppo_epochs):
                metrics |= update_policy(cfg, batch.samples, c.actor, kl_coef=kl_ctl.value)
                if c.critic is not None:
                    metrics |= update_critic(cfg, batch.samples, c.critic)
            metrics["time/learner"] = time.perf_counter() - t0 + metrics.pop("time/learner_forward")
            report = c.sync.push(version=c.sync.version + 1)
            metrics |= {"time/sync": report.seconds, "sync/weight_version": float(report.version)}
            if cfg.algo.kl.enabled:
                kl_ctl.update(metrics.get("policy/kl", 0.0), len(batch.samples))
            metrics["time/step"] = time.perf_counter() - t_step
            state = RunState(
                step=step, weight_version=c.sync.version, cursor=train_set.cursor, kl_coef=kl_ctl.value
            )
            if step == cfg.train.num_steps and eval_set is not None and cfg.eval.every:
                metrics |= evaluate(cfg, make_executor, eval_set, c.reward)
            tracker.log(step, metrics)
            if cfg.ckpt.save_steps and step % cfg.ckpt.save_steps == 0:
                save_checkpoint(
                    ckpt_root,
                    state,
                    c.learner_groups(),
                    max_keep=cfg.ckpt.max_keep,
                    config=cfg.model_dump(mode="json"),
                )

        # ---- clean-up ---------------------------------------------------------------------------
        final = run_dir / "final_model"
        c.actor.export(directory=str(final), tokenizer_path=str(model_dir))
        summary = tracker.close()
        return PPOResult(run_dir=run_dir, final_model=final, history=tracker.history, summary=summary)
