"""The module a learner group's rank trains or scores with, built from its :class:`GroupSpec`."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_cli.runtime.learners.specs import GroupSpec

__all__ = ["build_model"]


def build_model(spec: GroupSpec, ds_config: dict, sp_group: Any = None) -> torch.nn.Module:
    """The module of ``spec.role``: an ``Actor`` (with LoRA, or QLoRA, when set), a reference, a critic or
    a reward model (frozen unless it trains). ``sp_group``: the rank's sequence-parallel group (actor and
    reference only; None without sequence parallelism)."""
    from rlhf_learner import Actor, load_causal_lm, load_critic, load_reference, load_reward_model

    if spec.role == "actor":
        lm = load_causal_lm(spec.model_path, options=spec.model, ds_config=ds_config, lora=spec.lora)
        return Actor(
            lm, temperature=spec.temperature, sequence_parallel_group=sp_group, compile=spec.model.compile
        )
    if spec.role == "ref":
        return load_reference(
            spec.model_path,
            options=spec.model,
            ds_config=ds_config,
            temperature=spec.temperature,
            sequence_parallel_group=sp_group,
        )
    if spec.role == "critic":
        return load_critic(spec.model_path, options=spec.model, ds_config=ds_config)
    model = load_reward_model(spec.model_path, options=spec.model, ds_config=ds_config)
    if not spec.trained:
        model.eval()
        model.requires_grad_(False)
    return model
