"""``rlhf ppo``: set-up (data, Ray, learner groups, engines, weight sync) -> train (rollout -> rewards ->
experience -> updates -> weight sync -> log -> checkpoint, each step) -> clean-up (export, summary)."""

from __future__ import annotations

import functools
import operator
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_cli.config import PPOConfig
from rlhf_cli.data.images import ImageEncoder
from rlhf_cli.data.prompts import PromptCursor, PromptSet
from rlhf_cli.ppo.components import Components, start_components
from rlhf_cli.ppo.evaluation import evaluate, warmup
from rlhf_cli.ppo.experience import make_experience, make_kl_controller, score_reference
from rlhf_cli.ppo.pipeline import RolloutPipeline, staleness_metrics, timed_take
from rlhf_cli.ppo.prompts import load_prompts, skipped_notes
from rlhf_cli.ppo.rewards import RewardStage
from rlhf_cli.ppo.rollout import RolloutBatch, RolloutStage
from rlhf_cli.ppo.settings import EvalSettings, StageSettings
from rlhf_cli.ppo.sources import executor_factory
from rlhf_cli.ppo.updates import update
from rlhf_cli.runtime.learners.memory_phases import MemoryPhases
from rlhf_cli.runtime.learners.specs import RankLayout
from rlhf_cli.runtime.plan.cluster import ClusterResources, placement_groups
from rlhf_cli.runtime.plan.model_sizes import ModelSizes
from rlhf_cli.runtime.plan.placement import Plan, make_plan
from rlhf_cli.runtime.runs.checkpoint import RunState, resumable_changes
from rlhf_cli.runtime.runs.run import (
    EvalSchedule,
    Run,
    claim_run_dir,
    dry_run_plan,
    prepare_run,
    resolve_model,
)
from rlhf_rollout import EngineClient
from transformers import AutoTokenizer

__all__ = ["PPOResult", "plan", "run"]


@dataclass(frozen=True, kw_only=True)
class PPOResult:
    run_dir: Path
    final_model: Path
    history: list[dict]
    summary: str
    layouts: dict[str, list[RankLayout]]
    """How each learner group's ranks held their model (data, sequence and tensor parallelism)."""


def plan(cfg: PPOConfig) -> Plan:
    """``--dry-run``: the inputs read as the run reads them before it starts (the data, the reward or
    agent file), then the placement plan."""
    notes = [] if cfg.builtin_task else _check_inputs(cfg)
    found = dry_run_plan(cfg, cfg.actor.pretrain, functools.partial(_plan_for, cfg))
    found.notes.extend(notes)
    return found


def _check_inputs(cfg: PPOConfig) -> list[str]:
    """Read the prompts and load the user's code as ``run`` does (nothing starts); what was read."""
    with tempfile.TemporaryDirectory() as tmp:  # the demo model, when no --actor.pretrain is given
        model_dir = resolve_model(cfg.actor.pretrain, Path(tmp), cfg.train.demo_model)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        train_set, eval_set = load_prompts(cfg, tokenizer, model_dir)  # says what it skipped
        _executors(cfg, tokenizer, train_set, eval_set).close()
    longest = max(len(p) for p in train_set.token_ids)  # an image prompt's ids hold its image tokens
    read = [f"inputs: {len(train_set.token_ids)} training prompts (the longest {longest} tokens)"]
    read += [f"{len(eval_set.token_ids)} evaluation prompts"] if eval_set else []
    return [", ".join(read) + " read; the reward source loaded"]


def _executors(cfg: PPOConfig, tokenizer: Any, train_set: PromptSet, eval_set: PromptSet | None) -> Any:
    """The run's executor factory (``executor_factory``), told whether any prompt shows images."""
    images = train_set.has_images or (eval_set is not None and eval_set.has_images)
    return executor_factory(cfg, tokenizer=tokenizer, encoder=train_set.encoder, images=images)


def _plan_for(cfg: PPOConfig, resources: ClusterResources, sizes: ModelSizes) -> Plan:
    return make_plan(cfg, resources, sizes=sizes)


def _resumable(cfg: PPOConfig) -> tuple[str, ...]:
    """The settings a resumed run may change (the evaluation prompts among them)."""
    return resumable_changes(lr_scheduled=cfg.lr_scheduled, extra=("eval.path",), backend=cfg.learner.backend)


def _start(
    cfg: PPOConfig,
    r: Run,
    tokenizer: Any,
    engines: EngineClient | None,
    *,
    per_episode: bool,
    stages: StageSettings,
) -> tuple[Components, RunState]:
    """The groups, engines and weight sync; the checkpoint's state (or the demo's warm-up); the engines
    given the policy's weights (a resumed run re-sends the version it had)."""
    skip = ("engines",) if engines else ()
    pgs = placement_groups(r.plan, timeout_s=cfg.ray.timeout_s, stop_at_exit=r.stop_at_exit, skip=skip)
    asynchronous = cfg.train.async_.enabled or per_episode  # agents call once per episode: batch them
    c = start_components(
        cfg,
        r.plan,
        pgs,
        r.model_dir,
        tokenizer,
        stop_at_exit=r.stop_at_exit,
        engines=engines,
        asynchronous=asynchronous,
        resume_from=r.resume_from,
    )
    state = r.resume(c.learner_groups(), RunState(cursor=PromptCursor(), kl_coef=cfg.algo.kl.coef))
    if r.resume_from is None and cfg.warmup_runs:
        encoder = ImageEncoder.for_model(r.model_dir) if cfg.train.demo_model == "vlm" else None
        warmup(stages.warmup, c.actor, tokenizer, encoder)
    c.sync.push(version=state.weight_version or 1)
    return c, state


def _pipeline(
    cfg: PPOConfig,
    stages: StageSettings,
    c: Components,
    make_executor: Any,
    prompts: PromptSet,
    *,
    first_step: int,
) -> RolloutPipeline:
    """Rollouts for the steps left, made ahead of training by up to ``--train.async.max_staleness``;
    asynchronous, the producer also runs the reference forward (it needs the samples alone)."""
    rewards = RewardStage(stages.rewards, reward_model=c.reward)
    rollout = RolloutStage(stages.rollout, make_executor=make_executor, prompts=prompts, rewards=rewards)
    batching, a = stages.experience.batching, cfg.train.async_
    if a.partial_rollout and not c.engines.pausable:
        raise ValueError("--train.async.partial_rollout: the engines given cannot pause (not asynchronous)")

    def score(batch: RolloutBatch) -> None:
        batch.reference_s = score_reference(batching, batch.samples, c.ref) if c.ref is not None else None

    phases = None
    if cfg.colocated:  # the hybrid engine: one schedule of release, acquire, offload and reload
        trained = [g for g in (c.actor, c.critic) if g is not None]
        phases = MemoryPhases(
            c.engines,
            trained,
            enabled=cfg.colocates_engines,
            sleep_level=cfg.vllm.sleep_level,
            offload=cfg.train.offload_during_rollout,
        )
        phases.before_rollout()  # after the start-up push
    return RolloutPipeline(
        lambda step, version: rollout.produce(step, weight_version=version),
        c.sync,
        steps=range(first_step, cfg.train.num_steps + 1),
        score=score if a.enabled else None,
        phases=phases,
        max_staleness=a.max_staleness,
        partial_rollout=a.partial_rollout,
        engines=c.engines,
    )


def demo_teacher(cfg: PPOConfig) -> Path:
    """The distillation demo's teacher (``cfg.demo_teacher``): the large demo model trained on the built-in
    task with the demo's warm-up and GRPO, for as many steps as the run has, in ``<run_dir>/teacher``
    (its final model is reused when it is there, e.g. by a resumed run)."""
    if not (cfg.ckpt.load_enable or cfg.logger.overwrite):  # the student's folder, refused before the teacher
        claim_run_dir(Path(cfg.logger.run_dir).absolute(), resuming=False, overwrite=False)
    run_dir = Path(cfg.logger.run_dir) / "teacher"
    final = run_dir / "final_model"
    if (final / "config.json").is_file():
        print(f"distillation demo: the teacher in {final}", file=sys.stderr)
        return final
    print(
        f"distillation demo: training the teacher (the large demo model, GRPO) in {run_dir}", file=sys.stderr
    )
    estimator = cfg.algo.advantage.model_copy(update={"estimator": "group_norm"})
    teacher_cfg = cfg.model_copy(
        update={
            "algo": cfg.algo.model_copy(update={"advantage": estimator, "distill": type(cfg.algo.distill)()}),
            "train": cfg.train.model_copy(update={"demo_model": "large"}),
            "logger": cfg.logger.model_copy(update={"run_dir": run_dir, "overwrite": True}),
            "ckpt": cfg.ckpt.model_copy(update={"load_enable": False, "save_steps": 0}),
        }
    )
    return run(teacher_cfg).final_model


def _with_demo_teacher(cfg: PPOConfig) -> PPOConfig:
    """``cfg``, with the distillation demo's teacher (trained first) when ``cfg.demo_teacher``."""
    if not cfg.demo_teacher:
        return cfg
    teacher = cfg.teacher.model_copy(update={"pretrain": str(demo_teacher(cfg).absolute())})
    return cfg.model_copy(update={"teacher": teacher})


def run(cfg: PPOConfig, *, engines: EngineClient | None = None) -> PPOResult:
    """Train (the distillation demo trains its teacher first). ``engines``: running rollout engines to use
    instead of new ones (e.g. tests); the run syncs its own weights into them first."""
    cfg = _with_demo_teacher(cfg)
    # ---- set-up -------------------------------------------------------------------------------
    plan_for = functools.partial(_plan_for, cfg)
    setup = prepare_run(cfg, pretrain=cfg.actor.pretrain, plan_for=plan_for, resumable=_resumable(cfg))
    tokenizer = AutoTokenizer.from_pretrained(str(setup.model_dir))
    train_set, eval_set = load_prompts(cfg, tokenizer, setup.model_dir)
    setup.check_resume(total_steps=cfg.train.num_steps, data_size=len(train_set.token_ids))
    executors = _executors(cfg, tokenizer, train_set, eval_set)  # loads user files now
    with setup.start() as r:
        r.stop_at_exit(executors.close)  # an OpenAI-API agent's server; nothing for the others
        stages = StageSettings.of(cfg)  # what each stage reads of the configuration
        c, state = _start(cfg, r, tokenizer, engines, per_episode=executors.per_episode, stages=stages)
        train_set.cursor = state.cursor
        make_executor = functools.partial(executors, c.engines)
        kl = cfg.algo.kl
        kl_ctl = make_kl_controller(value=state.kl_coef, target=kl.target, horizon=kl.horizon)
        notes = skipped_notes(cfg, train_set, eval_set)
        tracker = r.start_tracker(total_steps=cfg.train.num_steps, state=state, notes=notes)
        schedule = EvalSchedule(every=cfg.eval.every if eval_set else 0, last_step=cfg.train.num_steps)
        gpu = r.plan.device == "cuda"  # groups on their own GPUs: their forwards overlap
        rollouts = _pipeline(cfg, stages, c, make_executor, train_set, first_step=state.step + 1)
        r.stop_at_exit(rollouts.close)
        evaluated = functools.partial(
            _evaluated, stages.evaluation, rollouts, make_executor, eval_set, c.reward
        )

        # ---- train: one call per stage ------------------------------------------------------------
        for step in range(state.step + 1, cfg.train.num_steps + 1):
            t0 = time.perf_counter()
            before = evaluated(schedule.before(step))
            batch, waited = timed_take(rollouts, step)  # engines -> rewards -> filter (maybe made ahead)
            exp = make_experience(
                stages.experience, batch.samples, **c.scorers(), kl_coef=kl_ctl.value, concurrent=gpu
            )
            late = exp.pending_reference  # the reference forward, running: the actor's ranks fetch it
            upd = update(
                stages.update, exp.samples, **c.trained(), kl_coef=kl_ctl.value, step=step, reference=late
            )
            version = rollouts.policy_version(step)
            lag = staleness_metrics(batch, policy_version=version, eta=rollouts.max_staleness)
            synced = rollouts.sync()  # actor -> engines, as the next version
            if kl.enabled and upd.actor is not None:  # a frozen actor's KL says nothing new
                kl_ctl.update((upd.kl_mean or 0.0) if exp.kl_mean is None else exp.kl_mean, len(exp.samples))
            timing = {"time/learner": upd.seconds + exp.forward_s, "time/step": time.perf_counter() - t0}
            after = evaluated(schedule.after(step))
            state = RunState(
                step=step, weight_version=c.sync.version, cursor=batch.cursor, kl_coef=kl_ctl.value
            )
            state.wandb_run_id = tracker.wandb_run_id
            parts = (before, batch.metrics(), exp.metrics(), upd.metrics(), synced.metrics(), lag, waited)
            tracker.log(step, functools.reduce(operator.or_, parts) | timing | after)
            r.checkpoint(state, c.learner_groups())

        # ---- clean-up -------------------------------------------------------------------------------
        rollouts.close()
        tracker.notes += rollouts.phases.notes()
        return _finish(cfg, r, c, tracker)


def _evaluated(settings: EvalSettings, rollouts: RolloutPipeline, make_executor, eval_set, reward, due: bool):
    """The evaluation metrics when due, with the engines to itself (no batch generates meanwhile: an
    OpenAI-API agent's server and a reward-model group are shared with the rollouts)."""
    if not due:
        return {}
    with rollouts.exclusive():
        return evaluate(settings, make_executor, eval_set, reward)


def _finish(cfg: PPOConfig, r: Run, c: Components, tracker: Any) -> PPOResult:
    """Export the actor, draw the curve, summarise."""
    final = r.run_dir / "final_model"
    with r.exporting(final.name) as tmp:
        c.actor.export(directory=str(tmp), tokenizer_path=str(r.model_dir), options=cfg.export.options())
    summary = tracker.close()
    layouts = {name: g.layouts() for name, g in c.groups().items()}
    return PPOResult(
        run_dir=r.run_dir, final_model=final, history=tracker.history, summary=summary, layouts=layouts
    )
