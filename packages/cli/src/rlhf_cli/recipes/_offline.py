"""The loop the offline commands (sft, rm, dpo, kto) share: set-up (Ray, the trained group, the frozen
reference) -> train (batch -> per-rank micro-batches -> update step -> evaluate -> log -> checkpoint)
-> clean-up (export). What differs per command is an :class:`Objective`."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch
from rlhf_learner import StrategyOptions

from rlhf_cli import task
from rlhf_cli.checkpoint import RunState, check_resumable, latest_checkpoint, load_checkpoint, save_checkpoint
from rlhf_cli.config import OfflineConfig, dump_yaml
from rlhf_cli.data import PromptCursor
from rlhf_cli.examples import Example, ExampleSet, KTOExample, PreferencePair, split_heldout
from rlhf_cli.groups import GroupSpec, LearnerGroup, Role, launch_groups
from rlhf_cli.placement import (
    Plan,
    count_params,
    local_resources,
    make_offline_plan,
    placement_groups,
    start_ray,
)
from rlhf_cli.recipes._session import run_session
from rlhf_cli.tracking import Display, Tracker

__all__ = [
    "Groups",
    "Objective",
    "OfflineResult",
    "ReferenceObjective",
    "load_examples",
    "offline_plan",
    "resolve_base",
    "run_command",
    "run_offline",
    "sequence_logps",
    "total_steps",
    "with_reference",
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


@dataclass(kw_only=True)
class Groups:
    """The running learner groups of an offline run."""

    model: LearnerGroup
    ref: LearnerGroup | None
    placement_groups: dict[str, Any]

    def stop_ref(self) -> None:
        """Stop the reference group and free its bundles (after precomputing its log-probs)."""
        from ray.util.placement_group import remove_placement_group

        if self.ref is not None:
            self.ref.shutdown()
            self.ref = None
            remove_placement_group(self.placement_groups.pop("ref"))

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in (self.model, self.ref):
            if g is not None:
                g.shutdown()
        for pg in self.placement_groups.values():
            remove_placement_group(pg)


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


def resolve_base(cfg: OfflineConfig) -> Path:
    """The starting model: ``--model.pretrain``, or the built-in tiny model (built once, offline)."""
    if cfg.model.pretrain is not None:
        from rlhf_learner.models import check_model_dir

        check_model_dir(cfg.model.pretrain)
        return Path(cfg.model.pretrain)
    return task.build_demo_model(Path(cfg.logger.run_dir) / "base_model")


def offline_plan(cfg: OfflineConfig, *, with_ref: bool, connect: bool = False) -> Plan:
    """The placement plan (``--dry-run``): local resources, or the cluster's when ``connect``."""
    resources = start_ray(cfg)[0] if connect else local_resources(cfg)
    if cfg.model.pretrain:
        from rlhf_learner.models import check_model_dir

        check_model_dir(cfg.model.pretrain)
        n = count_params(Path(cfg.model.pretrain))
    else:
        n = task.demo_num_params()
    return make_offline_plan(cfg, resources, num_params=n, with_ref=with_ref)


def _strategy(cfg: OfflineConfig, world: int, *, frozen: bool) -> StrategyOptions:
    options = replace(
        cfg.ds,
        lr=cfg.learning_rate,
        micro_batch_size=cfg.train.micro_batch_size,
        grad_accum_steps=cfg.grad_accum_steps,
        seed=cfg.train.seed,
    )
    if frozen and options.zero_stage in (1, 2):  # no optimizer or gradients to shard: plain replicas
        options = replace(options, zero_stage=0, offload_optimizer=False)
    return options


def _start_groups(
    cfg: OfflineConfig, plan: Plan, pgs: dict[str, Any], model_dir: Path, *, role: Role
) -> Groups:
    """The trained group (``role``: actor for a policy, reward for a reward model) and the reference."""
    lora = getattr(cfg, "lora", None)
    specs = {
        "model": GroupSpec(
            role=role,
            model_path=str(model_dir),
            world_size=cfg.model.world_size,
            strategy=_strategy(cfg, cfg.model.world_size, frozen=False),
            model=cfg.model.options,
            lora=lora,
            trains=True,
        )
    }
    if plan.group("ref") is not None:
        ref = cfg.ref  # type: ignore[attr-defined]
        specs["ref"] = GroupSpec(
            role="ref",
            model_path=ref.pretrain or str(model_dir),
            world_size=ref.world_size,
            strategy=_strategy(cfg, ref.world_size, frozen=True),
            model=cfg.model.options,
        )
    from ray.util.placement_group import remove_placement_group

    groups: dict[str, LearnerGroup] = {}
    try:
        groups = launch_groups(specs, plan, pgs, timeout_s=cfg.ray.timeout_s)
        for g in groups.values():
            g.wait_setup()
    except BaseException:
        for g in groups.values():
            g.shutdown()
        for pg in pgs.values():
            remove_placement_group(pg)
        raise
    return Groups(model=groups["model"], ref=groups.get("ref"), placement_groups=pgs)


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
    if cfg.eval.path is not None:
        evals = load(Path(cfg.eval.path), "--eval.path")
    else:
        items, evals = split_heldout(items, cfg.eval.split, seed=cfg.train.seed)
    if cfg.eval.max_samples:
        evals = evals[: cfg.eval.max_samples]
    return items, evals


SCORING_CHUNK = 1024
"""Sequences per call when a group scores many (each call has the Ray timeout; progress is printed)."""


def sequence_logps(group: LearnerGroup, examples: Sequence[Example], *, micro_batch_size: int) -> list[float]:
    """Summed log-probs of each example's loss-mask tokens under ``group`` (a policy or reference),
    from padded rows as the training steps see them, in chunks of :data:`SCORING_CHUNK`; the ranks
    return one float per sequence."""
    out: list[float] = []
    for lo in range(0, len(examples), SCORING_CHUNK):
        chunk = examples[lo : lo + SCORING_CHUNK]
        out += group.sequence_logps(
            [e.token_ids for e in chunk], [e.loss_mask for e in chunk], micro_batch_size=micro_batch_size
        )
        if len(examples) > SCORING_CHUNK:
            print(f"{group.spec.role}: scored {len(out)}/{len(examples)} sequences", file=sys.stderr)
    return out


P = TypeVar("P", PreferencePair, KTOExample)


def with_reference(items: list[P], ref: LearnerGroup | None, *, micro_batch_size: int) -> list[P]:
    """``items`` with ``ref_logp`` filled in by the reference group (items that have it are kept)."""
    todo = [i for i, x in enumerate(items) if x.ref_logp is None]
    if not todo:
        return items
    if ref is None:
        raise RuntimeError("reference log-probs are missing and the reference group was stopped")
    seqs = [s for i in todo for s in items[i].sequences]
    logps = sequence_logps(ref, seqs, micro_batch_size=micro_batch_size)
    out = list(items)
    for k, i in enumerate(todo):
        out[i] = replace(items[i], ref_logp=(logps[2 * k], logps[2 * k + 1]))
    return out


def total_steps(cfg: OfflineConfig, num_examples: int) -> int:
    """Steps for ``--train.num_epochs`` passes, rounded up (batches run on across epoch ends, so every
    example is trained on), at most ``--train.max_steps``."""
    steps = -(-cfg.train.num_epochs * num_examples // cfg.train.batch_size)
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps else steps


def _split(cfg: OfflineConfig, group: LearnerGroup, batch: list[E]) -> list[list[list[E]]]:
    """The step's examples as ``[rank][micro-batch][example]`` (contiguous shards, equal sizes)."""
    m = cfg.train.micro_batch_size
    return [[shard[i : i + m] for i in range(0, len(shard), m)] for shard in group.shards(batch)]


def run_command(
    cfg: OfflineConfig,
    *,
    role: Role,
    builtin: str,
    load: Callable[[Path, Any, str], list[E]],
    make_objective: Callable[[Groups], Objective[E]],
    with_ref: bool,
) -> OfflineResult:
    """A command's whole run: the starting model and its tokenizer, ``load(path, tokenizer, flag)``'s
    examples (``builtin`` data when ``--data.path`` is unset), then :func:`run_offline`."""
    from transformers import AutoTokenizer

    base = resolve_base(cfg)
    ref_dir = getattr(getattr(cfg, "ref", None), "pretrain", None)
    if ref_dir is not None:
        from rlhf_learner.models import check_model_dir

        try:
            check_model_dir(ref_dir)
        except (ValueError, FileNotFoundError) as err:
            raise ValueError(f"--ref.pretrain: {err}") from None
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    train, evals = load_examples(cfg, lambda path, flag: load(path, tokenizer, flag), builtin=builtin)
    return run_offline(
        cfg,
        role=role,
        model_dir=base,
        tokenizer_dir=base,
        train_items=train,
        eval_items=evals,
        make_objective=make_objective,
        with_ref=with_ref,
    )


class ReferenceObjective(Generic[P]):
    """What DPO and KTO share: reference log-probs attached to their examples (computed by the
    reference group per step, or for every example once with ``--ref.precompute``)."""

    cfg: Any
    groups: Groups

    def _ref(self, items: list[P]) -> list[P]:
        return with_reference(items, self.groups.ref, micro_batch_size=self.cfg.train.micro_batch_size)

    def prepare(self, train: list[P], evals: list[P]) -> tuple[list[P], list[P]]:
        """The evaluation examples are scored by the reference once, here (every evaluation reuses
        them); the training examples too with ``--ref.precompute``, after which the group stops."""
        evals = self._ref(evals)
        if not self.cfg.ref.precompute:
            return train, evals
        train = self._ref(train)
        self.groups.stop_ref()
        return train, evals

    def _with_ref(
        self, per_rank: Sequence[Sequence[Sequence[P]]]
    ) -> list[list[tuple[list[P], torch.Tensor]]]:
        """The step's micro-batches with their reference log-probs as ``[2n]`` tensors (first
        sequences, then second: chosen then rejected, or examples then mismatched)."""
        flat = iter(self._ref([x for mbs in per_rank for mb in mbs for x in mb]))
        out = []
        for mbs in per_rank:
            out.append([])
            for mb in mbs:
                items = [next(flat) for _ in mb]
                ref = torch.tensor([x.ref_logp[0] for x in items] + [x.ref_logp[1] for x in items])
                out[-1].append((items, ref))
        return out

    def _logps(self, items: list[P]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Policy and reference summed log-probs of each item's two sequences:
        ``(policy first, policy second, reference first, reference second)``, each ``[n]``."""
        items = self._ref(items)
        seqs = [x.sequences[0] for x in items] + [x.sequences[1] for x in items]
        logp = torch.tensor(
            sequence_logps(self.groups.model, seqs, micro_batch_size=self.cfg.train.micro_batch_size)
        )
        ref = torch.tensor([x.ref_logp for x in items])
        n = len(items)
        return logp[:n], logp[n:], ref[:, 0], ref[:, 1]

    def finish(self, train: list[P]) -> None:
        pass


def run_offline(
    cfg: OfflineConfig,
    *,
    role: Role,
    model_dir: Path,
    tokenizer_dir: Path,
    train_items: list[E],
    eval_items: list[E],
    make_objective: Callable[[Groups], Objective[E]],
    with_ref: bool,
) -> OfflineResult:
    """Train ``make_objective(groups)`` on ``train_items`` and export the model (see the module doc)."""
    # ---- set-up -------------------------------------------------------------------------------
    run_dir = Path(cfg.logger.run_dir)
    ckpt_root = run_dir / "checkpoints"
    config = cfg.model_dump(mode="json")
    found = latest_checkpoint(ckpt_root) if cfg.ckpt.load_enable else None
    if found is not None:
        check_resumable(found, config)
    elif cfg.ckpt.load_enable:
        print(f"--ckpt.load_enable: no checkpoint in {ckpt_root}; starting from step 0", file=sys.stderr)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    num_params = count_params(model_dir)
    if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):  # a plan that cannot fit fails first
        make_offline_plan(cfg, local_resources(cfg), num_params=num_params, with_ref=with_ref)
    with run_session(cfg) as session:
        plan = make_offline_plan(cfg, session.resources, num_params=num_params, with_ref=with_ref)
        groups = _start_groups(
            cfg, plan, placement_groups(plan, timeout_s=cfg.ray.timeout_s), model_dir, role=role
        )
        session.stop_at_exit(groups.shutdown)
        objective = make_objective(groups)
        state = RunState(cursor=PromptCursor())
        if found is not None:
            state = load_checkpoint(found, {"model": groups.model})
        train_items, eval_items = objective.prepare(train_items, eval_items)
        train_set = ExampleSet(items=train_items, seed=cfg.train.seed, cursor=state.cursor)
        steps = total_steps(cfg, len(train_items))
        tracker = session.tracker = Tracker(
            run_dir,
            tensorboard=cfg.logger.tensorboard,
            wandb_project=cfg.logger.wandb_project,
            progress=cfg.logger.progress,
            total_steps=steps,
            config=config,
            resume_step=state.step,
            display=objective.display,
        )
        evaluating = bool(eval_items) and cfg.eval.every > 0

        # ---- train ------------------------------------------------------------------------------
        for step in range(state.step + 1, steps + 1):
            t0 = time.perf_counter()
            metrics: dict[str, float] = {}
            if evaluating and (step == 1 or (step - 1) % cfg.eval.every == 0):
                metrics |= objective.evaluate(eval_items)
            metrics |= objective.step(_split(cfg, groups.model, train_set.next_batch(cfg.train.batch_size)))
            if evaluating and step == steps:  # after the last update (as rlhf ppo does)
                metrics |= objective.evaluate(eval_items)
            metrics["train/epoch"] = train_set.cursor.epoch + train_set.cursor.index / len(train_items)
            metrics["time/step"] = time.perf_counter() - t0
            state = RunState(step=step, cursor=train_set.cursor)
            tracker.log(step, metrics)
            if cfg.ckpt.save_steps and step % cfg.ckpt.save_steps == 0:
                save_checkpoint(
                    ckpt_root, state, {"model": groups.model}, max_keep=cfg.ckpt.max_keep, config=config
                )

        # ---- clean-up ---------------------------------------------------------------------------
        objective.finish(train_items)
        final = run_dir / "final_model"
        groups.model.export(directory=str(final), tokenizer_path=str(tokenizer_dir))
        adapter = run_dir / "final_adapter"
        has_adapter = groups.model.export_adapter(directory=str(adapter))
        summary = tracker.close()
        return OfflineResult(
            run_dir=run_dir,
            final_model=final,
            adapter=adapter if has_adapter else None,
            history=tracker.history,
            summary=summary,
        )
