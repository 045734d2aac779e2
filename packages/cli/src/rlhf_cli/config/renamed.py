"""Settings that moved: their old dotted names, still accepted in flags, YAML files and checkpoints."""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["RENAMED", "current_name"]

_ENGINE_SETTINGS = (
    "num_engines",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "kv_cache_gib",
    "dtype",
)

RENAMED: dict[str, str] = {
    "ds": "learner",
    "train.backend": "learner.backend",
    "train.max_steps": "train.num_steps",
    "data.prompt_key": "data.input_key",
    **{f"vllm.{k}": f"rollout.{k}" for k in _ENGINE_SETTINGS},
}
"""Old name (a section or a key) -> the name it has now. ``--learner.*`` became ``--learner.*`` when training
backends other than DeepSpeed arrived; the engine settings every rollout backend has left ``--vllm.*``;
the offline commands took rlhf ppo's names for the run's length and the prompt's key."""


def current_name(path: str, known: Collection[str] = ()) -> str:
    """``path`` under its current name, when it has an old one whose new one is ``known`` (or ``known``
    is empty); else ``path`` itself (so an old name a command lacks is reported as typed)."""
    for old, new in RENAMED.items():
        if path == old or path.startswith(old + "."):
            moved = new + path[len(old) :]
            return moved if not known or moved in known else path
    return path
