"""Settings that moved, and other names: read in flags, YAML files and checkpoints as the current ones."""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["RENAMED", "current_name", "names_for"]

_ENGINE_SETTINGS = (
    "num_engines",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "kv_cache_gib",
    "dtype",
)
_OFFLINE = ("sft", "rm", "dpo", "kto")

RENAMED: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "ds": ("learner", None),
    "train.backend": ("learner.backend", None),
    "train.max_steps": ("train.num_steps", _OFFLINE),
    "data.prompt_key": ("data.input_key", _OFFLINE),
    **{f"vllm.{k}": (f"rollout.{k}", ("ppo",)) for k in _ENGINE_SETTINGS},
    "actor.freeze_vision_tower": ("actor.model.freeze_vision_tower", ("ppo",)),
    "model.freeze_vision_tower": ("model.options.freeze_vision_tower", _OFFLINE),
}
"""Other name (a section or a key) -> (the name it has now, the commands that read it; None: every one).
``--ds.*`` became ``--learner.*`` when training backends other than DeepSpeed arrived (and
``--train.backend`` names the backend too); the engine settings every rollout backend has left
``--vllm.*``; the offline commands took rlhf ppo's names for the run's length and the prompt's key;
``--actor.freeze_vision_tower`` (and the offline ``--model.freeze_vision_tower``) is a short name for the model
option."""


def names_for(command: str | None) -> dict[str, str]:
    """The other names ``command`` reads (every one when ``command`` is None) -> the current names."""
    return {
        old: new for old, (new, only) in RENAMED.items() if only is None or command is None or command in only
    }


def current_name(path: str, known: Collection[str] = (), command: str | None = None) -> str:
    """``path`` under its current name, when it is another name ``command`` reads whose current one is
    ``known`` (or ``known`` is empty); else ``path`` itself (so a name a command lacks is reported as typed)."""
    for old, new in names_for(command).items():
        if path == old or path.startswith(old + "."):
            moved = new + path[len(old) :]
            return moved if not known or moved in known else path
    return path
