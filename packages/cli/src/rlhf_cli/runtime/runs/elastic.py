"""``--train.elastic``: a run that restarts after losing a host spans the nodes that are left, with fewer
data-parallel ranks each accumulating more micro-batches (the batch, and so the training, unchanged)."""

from __future__ import annotations

import os
import sys
from typing import TypeVar

from pydantic import ValidationError
from rlhf_learner.strategy import training_backend

from rlhf_cli.config import ConfigError, OfflineConfig, PPOConfig
from rlhf_cli.config.run import data_parallel_size

__all__ = ["check_elastic", "fit_to_cluster", "shrink_to"]

C = TypeVar("C", PPOConfig, OfflineConfig)

GROUPS = ("model", "ref", "teacher", "actor", "critic", "reward")
"""The sections of learner groups a command may have."""


def check_elastic(cfg: PPOConfig | OfflineConfig) -> None:
    """Refuse ``--train.elastic`` where a checkpoint cannot be loaded on fewer ranks than wrote it."""
    backend = cfg.learner.backend
    if cfg.train.elastic and not training_backend(backend).reshards_checkpoints:
        raise ConfigError(
            f"--train.elastic: --learner.backend {backend} cannot load a checkpoint on fewer ranks than wrote "
            "it, so a run that lost a host could not resume; use --learner.backend fsdp2"
        )


def shrink_to(cfg: C, nodes: int) -> tuple[C, list[str]]:
    """``cfg`` with every learner group that spans more than ``nodes`` nodes spanning ``nodes``, and what
    changed, one entry per group (its ranks and data-parallel size)."""
    update, changes = {}, []
    for name in GROUPS:
        group = getattr(cfg, name, None)
        if group is None or group.num_nodes <= nodes:
            continue
        smaller = group.model_copy(update={"num_nodes": nodes})  # (validated with the whole, below)
        update[name] = smaller
        dp = (
            data_parallel_size(group.world_size, cfg.learner),
            data_parallel_size(smaller.world_size, cfg.learner),
        )
        changes.append(
            f"--{name}.num_nodes {group.num_nodes} -> {nodes} ({group.world_size} -> {smaller.world_size} ranks, "
            f"data-parallel {dp[0]} -> {dp[1]})"
        )
    if not update:
        return cfg, []
    data = cfg.model_dump(by_alias=True) | {k: v.model_dump(by_alias=True) for k, v in update.items()}
    try:  # validated again: the batch must still split over the smaller groups
        return type(cfg).model_validate(data), changes
    except ValidationError as err:
        why = err.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"--train.elastic: the run does not fit {nodes} node(s): {why}") from None


def fit_to_cluster(cfg: C) -> C:
    """``cfg`` shrunk (:func:`shrink_to`) to the nodes of ``--ray.address``'s cluster that are alive, said in
    one line on stderr; unchanged without a cluster address (a local cluster is one node)."""
    if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
        return cfg
    import ray

    from rlhf_cli.runtime.plan.cluster import start_ray

    resources, started = start_ray(cfg)
    if started:
        ray.shutdown()
    cfg, changes = shrink_to(cfg, resources.nodes)
    if changes:
        print(
            f"--train.elastic: {resources.nodes} node(s) left: {'; '.join(changes)}; each data-parallel rank "
            "accumulates more micro-batches, so the batch and the step are unchanged",
            file=sys.stderr,
        )
    return cfg
