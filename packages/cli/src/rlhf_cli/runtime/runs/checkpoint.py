"""Run-level checkpoints: every learner group's DeepSpeed state plus the run's own state, written under
a temporary name and renamed when complete, so a crash never leaves a checkpoint that looks valid.

Layout: ``<run_dir>/checkpoints/step_000004/{actor,critic}/`` + ``run_state.json``, and
``<run_dir>/checkpoints/latest`` naming the newest complete one. On several nodes ``run_dir`` must be
on a file system every node sees."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhf_learner.strategy import training_backend

from rlhf_cli.config.loading import current_tree, flat_items
from rlhf_cli.data.prompts import PromptCursor
from rlhf_cli.runtime.learners.group import LearnerGroup
from rlhf_cli.runtime.runs.failures import RunFinished

__all__ = [
    "RunFinished",
    "RunState",
    "check_resumable",
    "latest_checkpoint",
    "load_checkpoint",
    "read_run_state",
    "resumable_changes",
    "save_checkpoint",
]

STATE_FILE = "run_state.json"


@dataclass(kw_only=True)
class RunState:
    """What the driver needs to continue exactly where it stopped."""

    step: int = 0
    """Last completed step."""
    weight_version: int = 0
    """Version the engines hold."""
    cursor: PromptCursor
    kl_coef: float = 0.0
    wandb_run_id: str | None = None
    """The W&B run to continue on resume (None: no W&B)."""


RESUMABLE_CHANGES = (
    "train.num_steps",
    "train.max_restarts",
    "train.elastic",
    "train.num_epochs",
    "ckpt.",
    "logger.",
    "export.",
    "ray.",
    "eval.every",
    "eval.max_samples",
    "eval.pass_threshold",
    "eval.temperature",
    "eval.n_samples",
    "weightsync.timeout_s",
    "train.async.",
    "train.pin_cores",
    "train.overlap_reference",
)
"""Settings a resumed run may change; every other one must equal the checkpoint's (the step counts only
without a learning-rate schedule: ``resumable_changes``). (``rlhf ppo`` may
also change ``eval.path``; for the offline commands it decides the held-out split.)"""


GROUP_SIZES = tuple(
    f"{g}.{k}"
    for g in ("model", "ref", "teacher", "actor", "critic", "reward")
    for k in ("num_nodes", "num_devices_per_node")
)
"""Every learner group's rank count: a resumed run may change them when its backend reshards checkpoints."""


def resumable_changes(
    *, lr_scheduled: bool, extra: tuple[str, ...] = (), backend: str = "deepspeed"
) -> tuple[str, ...]:
    """``RESUMABLE_CHANGES`` plus ``extra``, less the run's length when a learning-rate schedule spans it
    (a resumed run with another length would follow another curve from the checkpoint's step on), plus the
    groups' rank counts when the training ``backend`` reshards its checkpoints on load."""
    length = ("train.num_steps", "train.num_epochs")
    keep = tuple(k for k in RESUMABLE_CHANGES if not (lr_scheduled and k in length))
    reshards = training_backend(backend).reshards_checkpoints
    return (*keep, *extra, *(GROUP_SIZES if reshards else ()))


def check_compatible(
    saved: dict, current: dict, *, where: Path, resumable: tuple[str, ...] = RESUMABLE_CHANGES
) -> None:
    """Raise naming the first setting that differs from the checkpoint's (except ``resumable`` ones). A
    setting the checkpoint does not have was added since it was written: it is not compared (older
    checkpoints stay resumable)."""
    a, b = dict(flat_items(saved)), dict(flat_items(current))
    for key in sorted(set(a) | set(b)):
        if key.startswith(resumable) or key not in a:
            continue
        if a.get(key) != b.get(key):
            raise ValueError(
                f"--ckpt.load_enable: {where} was written with {key}={a.get(key)!r}, this run has "
                f"--{key} {b.get(key)!r}; resume with the same settings (only steps, checkpointing, logging, "
                "evaluation and Ray options may change, and rank counts where --learner.backend reshards checkpoints)"
            )


def save_checkpoint(
    root: Path, state: RunState, groups: dict[str, LearnerGroup], *, max_keep: int, config: dict
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{state.step:06d}"
    tmp, final = root / f".tmp-{name}", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for role, group in groups.items():
        group.save(directory=str(tmp / role), tag="state")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(name)
    os.replace(pointer, root / "latest")
    complete = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())
    for old in complete[:-max_keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``latest`` names (written after the checkpoint was complete), else the newest
    complete ``step_*`` (a run killed between the two writes, or ``latest``'s folder deleted to go back),
    or None. Half-written ones (``.tmp-*``) are never taken; one that ``latest`` names but that lost its
    ``run_state.json`` is refused, naming the file."""
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if path.is_dir():
            if not (path / STATE_FILE).is_file():
                raise ValueError(f"--ckpt.load_enable: {path / STATE_FILE} is missing; {_damaged(path)}")
            return path
    complete = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())
    return complete[-1] if complete else None


def _damaged(path: Path) -> str:
    return f"the checkpoint is damaged (delete {path} to resume from an earlier one)"


def read_run_state(path: Path) -> RunState:
    """The checkpoint's ``run_state.json``, checked (a field missing, of the wrong type or negative is
    refused in one line naming the file and the field)."""
    from pydantic import TypeAdapter, ValidationError

    file = path / STATE_FILE
    try:
        text = file.read_text()
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--ckpt.load_enable: {file} is not JSON ({err}); {_damaged(path)}") from None
    cursor = raw.get("cursor") if isinstance(raw, dict) else None
    needed = [k for k in ("step", "weight_version", "cursor") if not isinstance(raw, dict) or k not in raw]
    needed += [f"cursor.{k}" for k in ("epoch", "index") if isinstance(cursor, dict) and k not in cursor]
    if needed:  # never a default: a data position of 0 would silently restart the data
        raise ValueError(f"--ckpt.load_enable: {file}: {needed[0]}: missing; {_damaged(path)}")
    try:
        state = TypeAdapter(RunState).validate_json(text, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ValueError(f"--ckpt.load_enable: {file}: {where}: {first['msg']}; {_damaged(path)}") from None
    cursor = state.cursor
    if min(state.step, state.weight_version, cursor.epoch, cursor.index) < 0:
        raise ValueError(f"--ckpt.load_enable: {file}: a step, version or data position is negative")
    return state


def check_resumable(path: Path, config: dict, *, resumable: tuple[str, ...] = RESUMABLE_CHANGES) -> None:
    """Before start-up: the checkpoint at ``path`` was written by a run with the same settings (except
    ``resumable`` ones)."""
    saved = path / "config.json"
    if not saved.is_file():
        raise ValueError(f"--ckpt.load_enable: {path} has no config.json (not written by an rlhf command?)")
    written = current_tree(json.loads(saved.read_text()))  # settings that moved since, under their new names
    check_compatible(written, config, where=path, resumable=resumable)


def zero_partitioned(path: Path | None, role: str) -> bool:
    """Whether checkpoint ``path`` holds ``role``'s optimizer as ZeRO partitions (written at ZeRO-1/2/3):
    that group resumes at its configured stage even on one rank, where ``StrategyOptions.for_ranks``
    would pick stage 0 (whose engine reads the optimizer from the model-states file instead)."""
    return path is not None and any((path / role).glob("*/zero_pp_rank_*optim_states.pt"))


def load_checkpoint(path: Path, groups: dict[str, LearnerGroup]) -> RunState:
    state = read_run_state(path)
    for role, group in groups.items():
        if not (path / role).is_dir():
            raise ValueError(
                f"--ckpt.load_enable: {path} has no state for the {role} group; {_damaged(path)}"
            )
        group.load(directory=str(path / role), tag="state")
    return state
