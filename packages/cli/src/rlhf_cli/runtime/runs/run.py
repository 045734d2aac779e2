"""The skeleton every training command shares (``rlhf ppo`` and the offline commands).

``prepare_run`` resolves the model, checks a checkpoint to resume before anything starts, writes the
run folder and checks that the plan fits; ``RunSetup.start`` then holds a Ray session whose plan is made
against the cluster. The ``Run`` it yields starts the tracker, decides when to evaluate and checkpoint, and registers every
started thing's stop with the session the moment it starts (``stop_at_exit``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_cli.config import ConfigError, OfflineConfig, PPOConfig, dump_yaml
from rlhf_cli.runtime.host.precision import slow_bf16_note
from rlhf_cli.runtime.plan.cluster import ClusterResources, local_resources, start_ray
from rlhf_cli.runtime.plan.model_sizes import ModelSizes, model_sizes
from rlhf_cli.runtime.plan.placement import Plan
from rlhf_cli.runtime.runs.checkpoint import (
    RESUMABLE_CHANGES,
    STATE_FILE,
    RunFinished,
    RunState,
    check_resumable,
    latest_checkpoint,
    load_checkpoint,
    read_run_state,
    save_checkpoint,
)
from rlhf_cli.runtime.runs.session import RunSession, run_session
from rlhf_cli.runtime.runs.tracking import PPO_DISPLAY, Display, Tracker, check_wandb_login

__all__ = ["EvalSchedule", "PlanFn", "Run", "RunSetup", "dry_run_plan", "prepare_run", "resolve_model"]

PlanFn = Callable[[ClusterResources, ModelSizes], Plan]
"""``(resources, sizes) -> Plan``: a command's placement plan (raises ConfigError if it cannot fit)."""


@dataclass(frozen=True, kw_only=True)
class EvalSchedule:
    """Evaluate before step 1 and every ``every`` steps, and once more after the last step."""

    every: int
    last_step: int

    def before(self, step: int) -> bool:
        return self.every > 0 and (step == 1 or (step - 1) % self.every == 0)

    def after(self, step: int) -> bool:
        return self.every > 0 and step == self.last_step


def resolve_model(pretrain: Path | str | None, run_dir: Path, demo: str = "small") -> Path:
    """The starting model: ``pretrain`` (checked), or the built-in ``demo`` model (built once, offline)."""
    if pretrain is not None:
        from rlhf_learner.models import check_model_dir

        check_model_dir(pretrain)
        return Path(pretrain).absolute()
    from rlhf_cli.demo.task import build_demo_model

    return build_demo_model(run_dir / ("base_model" if demo == "small" else f"base_model_{demo}"), demo)


def _sizes(cfg: PPOConfig | OfflineConfig, pretrain: Path | str | None) -> ModelSizes:
    if pretrain is not None:
        from rlhf_learner.models import check_model_dir

        check_model_dir(pretrain)
    return model_sizes(cfg)


def _joins_cluster(cfg: PPOConfig | OfflineConfig) -> bool:
    return bool(cfg.ray.address or os.environ.get("RAY_ADDRESS"))


def dry_run_plan(cfg: PPOConfig | OfflineConfig, pretrain: Path | str | None, plan_for: PlanFn) -> Plan:
    """``--dry-run``: the plan against the local machine, or the joined cluster's resources."""
    joins = _joins_cluster(cfg)
    resources = start_ray(cfg)[0] if joins else local_resources(cfg)
    plan = plan_for(resources, _sizes(cfg, pretrain))
    note = None if joins else slow_bf16_note(cfg, gpus=resources.gpus)  # other nodes, other CPUs
    plan.notes.extend([note] if note else [])
    return plan


@dataclass(kw_only=True)
class Run:
    """One training run in progress: its folder, model, plan, checkpoint to resume and Ray session."""

    cfg: PPOConfig | OfflineConfig
    run_dir: Path
    model_dir: Path
    plan: Plan
    session: RunSession
    resume_from: Path | None
    """The checkpoint to continue from (``--ckpt.load_enable`` found one), else None."""
    last_save: float = field(default_factory=time.monotonic)
    """When the last checkpoint was saved (monotonic seconds), or the run started."""

    @property
    def config(self) -> dict:
        return self.cfg.model_dump(mode="json")

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def stop_at_exit(self, stop: Callable[[], None], /, *, actors: Mapping[str, str] | None = None) -> None:
        self.session.stop_at_exit(stop, actors=actors)

    def resume(self, groups: dict[str, Any], fresh: RunState) -> RunState:
        """The checkpoint's state loaded into ``groups``, or ``fresh`` when there is none."""
        return load_checkpoint(self.resume_from, groups) if self.resume_from is not None else fresh

    def start_tracker(
        self, *, total_steps: int, state: RunState, display: Display = PPO_DISPLAY, notes: Sequence[str] = ()
    ) -> Tracker:
        """The run's metrics sinks; ``notes`` go under the summary table (e.g. what the data left out)."""
        log = self.cfg.logger
        tracker = Tracker(
            self.run_dir,
            tensorboard=log.tensorboard,
            wandb_project=log.wandb_project,
            wandb_id=state.wandb_run_id,
            progress=log.progress,
            total_steps=total_steps,
            config=self.config,
            resume_step=state.step,
            display=display,
            notes=notes,
        )
        self.session.tracker = tracker
        return tracker

    @contextlib.contextmanager
    def exporting(self, name: str) -> Iterator[Path]:
        """A temporary folder to export ``run_dir/name`` into, renamed to it once complete: a run killed
        while exporting leaves nothing half-written under the real name."""
        final, tmp, old = (self.run_dir / n for n in (name, f".{name}.tmp", f".{name}.old"))
        shutil.rmtree(tmp, ignore_errors=True)
        yield tmp
        if tmp.exists():  # (an export with nothing to write, e.g. no adapter, makes no folder)
            shutil.rmtree(old, ignore_errors=True)
            if final.exists():
                os.replace(final, old)  # whole until the new one is in place
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)

    def checkpoint(self, state: RunState, groups: dict[str, Any]) -> None:
        """Save when ``--ckpt.save_steps`` says this step is due, or ``--ckpt.save_minutes`` have passed
        since the last save (or the start)."""
        ckpt = self.cfg.ckpt
        by_steps = bool(ckpt.save_steps) and state.step % ckpt.save_steps == 0
        by_time = (
            ckpt.save_minutes is not None and time.monotonic() - self.last_save >= 60 * ckpt.save_minutes
        )
        if by_steps or by_time:
            save_checkpoint(self.ckpt_root, state, groups, max_keep=ckpt.max_keep, config=self.config)
            self.last_save = time.monotonic()


@dataclass(frozen=True, kw_only=True)
class RunSetup:
    """What is known before anything starts: the run folder, the model, the checkpoint to resume."""

    cfg: PPOConfig | OfflineConfig
    run_dir: Path
    model_dir: Path
    resume_from: Path | None
    resume_state: RunState | None
    """``resume_from``'s ``run_state.json``, read and checked before anything starts."""
    plan_for: PlanFn

    def check_resume(self, *, total_steps: int, data_size: int) -> None:
        """Before start-up: the checkpoint's data position lies within the data (else the data changed
        since), and :class:`RunFinished` when it holds the last step and the final model is there (a run
        killed after its last checkpoint but before its export only exports)."""
        state = self.resume_state
        if state is None:
            return
        if state.cursor.index > data_size:
            raise ValueError(
                f"--ckpt.load_enable: {self.resume_from / STATE_FILE}: cursor.index "
                f"{state.cursor.index} is past the {data_size} training examples: the data changed since"
            )
        if state.step < total_steps:
            return
        final = self.run_dir / "final_model"
        if (final / "config.json").is_file():
            raise RunFinished(
                f"{self.run_dir} is finished: its checkpoint {self.resume_from} holds the last step "
                f"({state.step} of {total_steps}); nothing to train (final model: {final}; delete it to "
                "export again)"
            )
        print(f"--ckpt.load_enable: {self.resume_from} is the last step: exporting only", file=sys.stderr)

    @contextlib.contextmanager
    def start(self) -> Iterator[Run]:
        """Hold the run's Ray session for the body; the plan is made against the cluster's resources."""
        sizes = model_sizes(self.cfg, self.model_dir)
        with run_session(self.cfg) as session:
            plan = self.plan_for(session.resources, sizes)
            yield Run(
                cfg=self.cfg,
                run_dir=self.run_dir,
                model_dir=self.model_dir,
                plan=plan,
                session=session,
                resume_from=self.resume_from,
            )


RUN_MARKERS = ("metrics.jsonl", "checkpoints", "final_model")
"""What a run leaves in its folder (the first is what makes it one: a run that trained wrote it)."""
RUN_OUTPUTS = (*RUN_MARKERS, "final_adapter", "summary.txt", "tensorboard", "config.yaml")
"""What ``--logger.overwrite`` deletes (the curves too: ``*_curve.png``); nothing else in the folder."""


def claim_run_dir(run_dir: Path, *, resuming: bool, overwrite: bool) -> None:
    """Refuse a folder that holds a previous run (in one line naming what was found), unless the run
    resumes it; with ``overwrite``, delete that run's outputs first."""
    found = [name for name in RUN_MARKERS if (run_dir / name).exists()]
    if not (run_dir / RUN_MARKERS[0]).is_file() or resuming:  # no run's metrics: nothing of a run to lose
        return
    if not overwrite:
        raise ConfigError(
            f"--logger.run_dir {run_dir} holds a previous run ({', '.join(found)}): resume it with "
            "--ckpt.load_enable, replace it with --logger.overwrite, or pick another folder"
        )
    for path in [run_dir / name for name in RUN_OUTPUTS] + sorted(run_dir.glob("*_curve.png")):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    print(f"--logger.overwrite: replaced the previous run in {run_dir}", file=sys.stderr)


def prepare_run(
    cfg: PPOConfig | OfflineConfig,
    *,
    pretrain: Path | str | None,
    plan_for: PlanFn,
    resumable: tuple[str, ...] = RESUMABLE_CHANGES,
) -> RunSetup:
    """Before anything starts: the checkpoint to resume (refused when written with other settings), the
    run folder and its ``config.yaml``, the model, and a plan that fits the local machine."""
    check_wandb_login(cfg.logger.wandb_project)
    run_dir = Path(cfg.logger.run_dir).absolute()  # engines and ranks may start in other folders
    ckpt_root = run_dir / "checkpoints"
    found = latest_checkpoint(ckpt_root) if cfg.ckpt.load_enable else None
    state = None
    if found is not None:
        check_resumable(found, cfg.model_dump(mode="json"), resumable=resumable)
        state = read_run_state(found)
        print(f"--ckpt.load_enable: resuming from {found} (step {state.step})", file=sys.stderr)
    elif cfg.ckpt.load_enable:  # (a run stopped before its first checkpoint): its outputs are replaced
        print(f"--ckpt.load_enable: no checkpoint in {ckpt_root}; starting from step 0", file=sys.stderr)
    claim_run_dir(run_dir, resuming=found is not None, overwrite=cfg.logger.overwrite or cfg.ckpt.load_enable)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    except OSError as err:
        why = "a file, not a folder" if run_dir.is_file() else err.strerror or str(err)
        raise ConfigError(f"--logger.run_dir {run_dir}: cannot write the run there ({why})") from None
    model_dir = resolve_model(pretrain, run_dir, getattr(cfg.train, "demo_model", "small"))
    if not _joins_cluster(cfg):
        resources = local_resources(cfg)
        plan_for(resources, model_sizes(cfg, model_dir))  # a plan that cannot fit fails first
        note = slow_bf16_note(cfg, gpus=resources.gpus)
        if note:
            print(f"warning: {note}", file=sys.stderr)
    return RunSetup(
        cfg=cfg,
        run_dir=run_dir,
        model_dir=model_dir,
        resume_from=found,
        resume_state=state,
        plan_for=plan_for,
    )
