"""The loop the offline commands (sft, rm, dpo, kto, distill) share: set-up (the run skeleton, the trained
group, the frozen reference or teacher) -> train (batch -> per-rank micro-batches -> update step -> evaluate -> log ->
checkpoint) -> clean-up (export). What differs per command is an :class:`Objective`."""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from rlhf_cli.config import OfflineConfig
from rlhf_cli.config.run import data_parallel_size
from rlhf_cli.data.examples import ExampleSet, split_heldout
from rlhf_cli.data.images import check_sharded_mix, image_encoder
from rlhf_cli.data.prompts import PromptCursor
from rlhf_cli.demo import task
from rlhf_cli.runtime.learners.group import LearnerGroup, launch_groups
from rlhf_cli.runtime.learners.specs import GroupSpec, RankLayout, Role, group_strategy
from rlhf_cli.runtime.plan.cluster import ClusterResources, placement_groups
from rlhf_cli.runtime.plan.model_sizes import ModelSizes
from rlhf_cli.runtime.plan.placement import Plan, make_offline_plan
from rlhf_cli.runtime.runs.checkpoint import RunState, resumable_changes, zero_partitioned
from rlhf_cli.runtime.runs.failures import naming_nonfinite
from rlhf_cli.runtime.runs.run import EvalSchedule, Run, dry_run_plan, prepare_run, resolve_model
from rlhf_cli.runtime.runs.tracking import Display

__all__ = [
    "Groups",
    "Objective",
    "OfflineResult",
    "load_examples",
    "offline_plan",
    "run_command",
    "total_steps",
]

E = TypeVar("E")


@dataclass(frozen=True, kw_only=True)
class OfflineResult:
    run_dir: Path
    final_model: Path
    adapter: Path | None
    """The LoRA adapter alone (``final_adapter``), when the run trained one."""
    history: list[dict]
    summary: str
    layouts: dict[str, list[RankLayout]]
    """How each group's ranks held their model (data, sequence and tensor parallelism)."""


@dataclass(kw_only=True)
class Groups:
    """The running learner groups of an offline run (their stops are registered with the run)."""

    model: LearnerGroup
    ref: LearnerGroup | None
    """The frozen group: the reference (dpo, kto) or the teacher (distill); None once stopped."""
    free_ref_bundles: Callable[[], None] = lambda: None
    """Removes the reference's placement group (registered with the run too; removing twice is fine)."""

    def stop_ref(self) -> None:
        """Stop the reference group and free its bundles (after precomputing its log-probs)."""
        if self.ref is not None:
            self.ref.shutdown()
            self.ref = None
            self.free_ref_bundles()


class Objective(Protocol[E]):
    """One command's training: its step, its evaluation and its curves."""

    display: Display

    def prepare(self, train: list[E], evals: list[E]) -> tuple[list[E], list[E]]:
        """Before the first step (e.g. precompute reference log-probs); returns the examples to use."""
        ...

    def step(self, per_rank: Sequence[Sequence[Sequence[E]]]) -> dict[str, float]:
        """One optimizer step; ``per_rank[r]`` is rank r's list of micro-batches."""
        ...

    def evaluate(self, examples: list[E]) -> dict[str, float]: ...

    def finish(self, train: list[E]) -> None:
        """After the last step, before the export (e.g. store the reward normalisation)."""
        ...


def _plan_for(cfg: OfflineConfig, with_ref: bool, resources: ClusterResources, sizes: ModelSizes) -> Plan:
    return make_offline_plan(cfg, resources, with_ref=with_ref, sizes=sizes)


def offline_plan(
    cfg: OfflineConfig, *, with_ref: bool, load: Callable[[Path, Any, str], list] | None = None
) -> Plan:
    """``--dry-run``: the data files read as the run reads them (``load``), then the placement plan."""
    notes = _check_data(cfg, load) if load is not None else []
    found = dry_run_plan(cfg, cfg.model.pretrain, functools.partial(_plan_for, cfg, with_ref))
    found.notes.extend(notes)
    return found


def _check_data(cfg: OfflineConfig, load: Callable[..., list]) -> list[str]:
    """Read ``--data.path`` and ``--eval.path`` (when given) with the model's tokenizer; what was read."""
    from transformers import AutoTokenizer

    given = [(p, f) for p, f in ((cfg.data.path, "--data.path"), (cfg.eval.path, "--eval.path")) if p]  # type: ignore[attr-defined]
    if not given:
        return []
    with tempfile.TemporaryDirectory() as tmp:  # the demo model, when no --model.pretrain is given
        model_dir = resolve_model(cfg.model.pretrain, Path(tmp))
        tokenizer, encoder = AutoTokenizer.from_pretrained(str(model_dir)), image_encoder(model_dir)
        return [
            f"inputs: {flag} {path}: {len(load(Path(path), tokenizer, flag, encoder))} examples read"
            for path, flag in given
        ]


def _start_groups(cfg: OfflineConfig, r: Run, *, role: Role, steps: int) -> Groups:
    """The trained group (``role``: actor for a policy, reward for a reward model; its learning-rate
    schedule spans ``steps`` optimizer steps) and the reference."""

    def strategy(world: int, *, frozen: bool) -> Any:
        return group_strategy(
            cfg.learner,
            lr=cfg.learning_rate,
            micro_batch_size=cfg.train.micro_batch_size,
            grad_accum_steps=cfg.grad_accum_steps,
            seed=cfg.train.seed,
            world_size=world,
            frozen=frozen,
            lr_schedule=None if frozen else cfg.model.lr_schedule(cfg.learning_rate, steps),
            keep_stage=zero_partitioned(r.resume_from, "model"),
        )

    w, path = cfg.model.world_size, str(r.model_dir)
    specs = {
        "model": GroupSpec(
            role=role,
            model_path=path,
            world_size=w,
            strategy=strategy(w, frozen=False),
            model=cfg.model.options,
            lora=getattr(cfg, "lora", None),
            trains=True,
        )
    }
    frozen = cfg.frozen_group
    if frozen is not None and r.plan.group(frozen) is not None:
        shape = cfg.frozen
        specs[frozen] = GroupSpec(
            role="ref",  # a frozen policy: the reference, or the teacher
            model_path=shape.pretrain or path,
            world_size=shape.world_size,
            strategy=strategy(shape.world_size, frozen=True),
            model=cfg.model.options,
        )
    pgs = placement_groups(r.plan, timeout_s=cfg.ray.timeout_s, stop_at_exit=r.stop_at_exit)
    groups = launch_groups(specs, r.plan, pgs, timeout_s=cfg.ray.timeout_s, stop_at_exit=r.stop_at_exit)
    for g in groups.values():
        g.wait_setup()
    return Groups(
        model=groups["model"], ref=groups.get(frozen or ""), free_ref_bundles=lambda: pgs.free(frozen or "")
    )


def load_examples(
    cfg: OfflineConfig, load: Callable[[Path, str], list[E]], *, builtin: str
) -> tuple[list[E], list[E]]:
    """Training and evaluation examples: ``load(path, flag)`` of ``--data.path`` (unset: the built-in
    task's ``builtin`` data, written to the run folder) and of ``--eval.path``, or a held-out split."""
    path = cfg.data.path  # type: ignore[attr-defined]
    if path is None:
        path = task.write_data(
            builtin, Path(cfg.logger.run_dir) / "data" / f"{builtin}.jsonl", seed=cfg.train.seed
        )
    items = load(Path(path), "--data.path")
    seqs = [s for x in items for s in getattr(x, "sequences", (x,))]
    pictured = sum(getattr(s, "images", None) is not None for s in seqs)
    ranks = data_parallel_size(cfg.model.world_size, cfg.learner)
    mix = dict(learner=cfg.learner, ranks=ranks)
    check_sharded_mix(pictured, len(seqs), **mix, what=str(path))
    if cfg.eval.path is not None:
        evals = load(Path(cfg.eval.path), "--eval.path")
    else:
        items, evals = split_heldout(items, cfg.eval.split, seed=cfg.train.seed)
    if cfg.eval.max_samples:
        evals = evals[: cfg.eval.max_samples]
    return items, evals


def total_steps(cfg: OfflineConfig, num_examples: int) -> int:
    """Steps for ``--train.num_epochs`` passes, rounded up (batches run on across epoch ends, so every
    example is trained on), at most ``--train.num_steps``."""
    steps = -(-cfg.train.num_epochs * num_examples // cfg.train.batch_size)
    return min(steps, cfg.train.num_steps) if cfg.train.num_steps else steps


def length_note(cfg: OfflineConfig, num_examples: int) -> str:
    """What ends the run, said at start-up: the epochs, or ``--train.num_steps`` before them."""
    t = cfg.train
    epochs = -(-t.num_epochs * num_examples // t.batch_size)
    of = f"{t.num_epochs} epoch(s) of {num_examples} examples in batches of {t.batch_size}"
    if t.num_steps and t.num_steps < epochs:
        return (
            f"{t.num_steps} steps: --train.num_steps {t.num_steps} ends the run before {of} ({epochs} steps)"
        )
    limit = f", before --train.num_steps {t.num_steps}" if t.num_steps else ""
    return f"{epochs} steps: {of}{limit}"


def _split(cfg: OfflineConfig, group: LearnerGroup, batch: list[E]) -> list[list[list[E]]]:
    """The step's examples as ``[rank][micro-batch][example]`` (contiguous shards, equal sizes)."""
    m = cfg.train.micro_batch_size
    return [[shard[i : i + m] for i in range(0, len(shard), m)] for shard in group.shards(batch)]


def _check_ref_dir(cfg: OfflineConfig) -> None:
    """The frozen group's folder (``--ref.pretrain``, ``--teacher.pretrain``) holds a model."""
    folder = cfg.frozen.pretrain if cfg.frozen is not None else None
    if folder is not None:
        from rlhf_learner.models import check_model_dir

        try:
            check_model_dir(folder, need_tokenizer=False)  # the policy's tokenizer is used
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"--{cfg.frozen_group}.pretrain: {err}") from None


def run_command(
    cfg: OfflineConfig,
    *,
    role: Role,
    builtin: str,
    load: Callable[[Path, Any, str], list[E]],
    make_objective: Callable[[Groups], Objective[E]],
    with_ref: bool,
) -> OfflineResult:
    """Train ``make_objective(groups)`` on ``load(path, tokenizer, flag)``'s examples (``builtin`` data
    when ``--data.path`` is unset) and export the model (see the module doc)."""
    from transformers import AutoTokenizer

    # ---- set-up -------------------------------------------------------------------------------
    plan_for = functools.partial(_plan_for, cfg, with_ref)
    resumable = resumable_changes(lr_scheduled=cfg.model.lr_scheduled, backend=cfg.learner.backend)
    setup = prepare_run(cfg, pretrain=cfg.model.pretrain, plan_for=plan_for, resumable=resumable)
    _check_ref_dir(cfg)
    tokenizer, encoder = AutoTokenizer.from_pretrained(str(setup.model_dir)), image_encoder(setup.model_dir)
    train_items, eval_items = load_examples(
        cfg, lambda path, flag: load(path, tokenizer, flag, encoder), builtin=builtin
    )
    steps = total_steps(cfg, len(train_items))
    setup.check_resume(total_steps=steps, data_size=len(train_items))
    print(f"rlhf {cfg.command}: {length_note(cfg, len(train_items))}", file=sys.stderr)
    with setup.start() as r:
        groups = _start_groups(cfg, r, role=role, steps=steps)
        layouts = {"model": groups.model.layouts()}
        objective = make_objective(groups)
        state = r.resume({"model": groups.model}, RunState(cursor=PromptCursor()))
        train_items, eval_items = objective.prepare(train_items, eval_items)
        train_set = ExampleSet(items=train_items, seed=cfg.train.seed, cursor=state.cursor)
        tracker = r.start_tracker(total_steps=steps, state=state, display=objective.display)
        schedule = EvalSchedule(every=cfg.eval.every if eval_items else 0, last_step=steps)

        # ---- train ------------------------------------------------------------------------------
        for step in range(state.step + 1, steps + 1):
            t0 = time.perf_counter()
            metrics = objective.evaluate(eval_items) if schedule.before(step) else {}
            with naming_nonfinite(f"step {step}"):
                metrics |= objective.step(
                    _split(cfg, groups.model, train_set.next_batch(cfg.train.batch_size))
                )
            if schedule.after(step):  # after the last update (as rlhf ppo does)
                metrics |= objective.evaluate(eval_items)
            metrics["train/epoch"] = train_set.cursor.epoch + train_set.cursor.index / len(train_items)
            metrics["time/step"] = time.perf_counter() - t0
            state = RunState(step=step, cursor=train_set.cursor, wandb_run_id=tracker.wandb_run_id)
            tracker.log(step, metrics)
            r.checkpoint(state, {"model": groups.model})

        # ---- clean-up ---------------------------------------------------------------------------
        objective.finish(train_items)
        return _export(cfg, r, groups.model, tracker, layouts)


def _export(cfg: OfflineConfig, r: Run, model: LearnerGroup, tracker: Any, layouts: dict) -> OfflineResult:
    """The final model (and the LoRA adapter alone, when there is one), the curve and the summary."""
    final, adapter = r.run_dir / "final_model", r.run_dir / "final_adapter"
    with r.exporting(final.name) as tmp:
        model.export(directory=str(tmp), tokenizer_path=str(r.model_dir), options=cfg.export.options())
    with r.exporting(adapter.name) as tmp:
        has_adapter = model.export_adapter(directory=str(tmp))
    summary = tracker.close()
    return OfflineResult(
        run_dir=r.run_dir,
        final_model=final,
        adapter=adapter if has_adapter else None,
        history=tracker.history,
        summary=summary,
        layouts=layouts,
    )
