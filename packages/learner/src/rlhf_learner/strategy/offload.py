"""Free a GPU for colocated rollout engines: a DeepSpeed engine's states to host memory and back."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["offload_states", "reload_states"]


def _why_not(engine: Any) -> str | None:
    """Why ``engine``'s states cannot (or need not) move, or None when they can."""
    if not torch.cuda.is_available():
        return "skipped: on CPU the states are in host memory already"
    if not hasattr(getattr(engine, "optimizer", None), "offload_states"):  # frozen, or ZeRO stage 0
        return "skipped: a frozen group (or ZeRO stage 0) has no optimizer states to move"
    params = engine.zero_offload_param() if hasattr(engine, "zero_offload_param") else None
    if params is not None and params.device != "none":  # an OffloadDeviceEnum (a str enum)
        return "skipped: --ds.offload_params keeps the parameters in host memory already"
    return None


def offload_states(engine: Any) -> str:
    """Move a training engine's parameters, gradients and optimizer states to host memory (DeepSpeed's
    ``offload_states``) while the engines generate. Returns what it did, or why it did nothing (on CPU, a
    frozen group): never a silent no-op."""
    why = _why_not(engine)
    if why is not None:
        return why
    engine.offload_states()
    torch.cuda.empty_cache()
    return "offloaded"


def reload_states(engine: Any) -> str:
    """Bring back what :func:`offload_states` moved, before the next update."""
    why = _why_not(engine)
    if why is not None:
        return why
    engine.reload_states()
    return "reloaded"
