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

from rlhf_cli.data import PromptCursor
from rlhf_cli.groups import LearnerGroup

__all__ = ["RunState", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

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


def save_checkpoint(root: Path, state: RunState, groups: dict[str, LearnerGroup], *, max_keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{state.step:06d}"
    tmp, final = root / f".tmp-{name}", root / name
    shutil.rmtree(tmp, ignore_errors=True)
    for role, group in groups.items():
        group.save(directory=str(tmp / role), tag="state")
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
    """The newest complete checkpoint, or None."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def load_checkpoint(path: Path, groups: dict[str, LearnerGroup]) -> RunState:
    raw = json.loads((path / STATE_FILE).read_text())
    for role, group in groups.items():
        if not (path / role).is_dir():
            raise ValueError(
                f"checkpoint {path} has no state for the {role} group (was it saved with another setup?)"
            )
        group.load(directory=str(path / role), tag="state")
    raw["cursor"] = PromptCursor(**raw["cursor"])
    return RunState(**raw)
