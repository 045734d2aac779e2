"""A run that heals: when a learner rank, an engine or a host dies, the whole run starts again in the same
driver, on the cluster as it now is, from its latest complete checkpoint (``--train.max_restarts``)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rlhf_cli.config import OfflineConfig, PPOConfig
from rlhf_cli.runtime.runs.checkpoint import latest_checkpoint
from rlhf_cli.runtime.runs.elastic import check_elastic, fit_to_cluster
from rlhf_cli.runtime.runs.failures import ActorDiedError

__all__ = ["restarted", "with_restarts"]

C = TypeVar("C", PPOConfig, OfflineConfig)
R = TypeVar("R")


def restarted(cfg: C) -> tuple[C, str]:
    """``cfg`` for the next start after a death, and where it starts from: the latest complete checkpoint
    (``--ckpt.load_enable``), or step 0 when there is none (the run folder's outputs replaced)."""
    found = latest_checkpoint(Path(cfg.logger.run_dir) / "checkpoints")
    if found is not None:
        ckpt = cfg.ckpt.model_copy(update={"load_enable": True})
        return cfg.model_copy(update={"ckpt": ckpt}), f"resuming from {found}"
    logger = cfg.logger.model_copy(update={"overwrite": True})
    ckpt = cfg.ckpt.model_copy(update={"load_enable": False})
    return cfg.model_copy(update={"logger": logger, "ckpt": ckpt}), "from step 0 (no checkpoint yet)"


def _checkpoint_step(cfg: PPOConfig | OfflineConfig) -> int:
    """The step of the run's latest complete checkpoint (0 without one)."""
    found = latest_checkpoint(Path(cfg.logger.run_dir) / "checkpoints")
    return int(found.name.rsplit("_", 1)[-1]) if found is not None else 0


def _stepped_since(cfg: PPOConfig | OfflineConfig, started: float, after_step: int) -> bool:
    """The attempt that started at ``started`` (wall clock) logged a step past ``after_step``."""
    log = Path(cfg.logger.run_dir) / "metrics.jsonl"
    if not log.is_file() or log.stat().st_mtime < started:
        return False
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    try:
        return bool(lines) and int(json.loads(lines[-1])["step"]) > after_step
    except (ValueError, KeyError):  # a line cut by the death
        return len(lines) > 1 and int(json.loads(lines[-2]).get("step", 0)) > after_step


def with_restarts(run: Callable[[C], R], cfg: C) -> R:
    """``run(cfg)``, started again after each death (:class:`ActorDiedError`, which has stopped every
    group and engine by then) at most ``--train.max_restarts`` times; each death and restart is one line
    on stderr. One more death raises, as a run without restarts does, and so does a death before the
    attempt trained a step (start-up failing the same way again, e.g. a rank out of memory loading its
    model, is not retried). With ``--train.elastic``, each restart first fits the groups to the nodes left
    (:func:`fit_to_cluster`)."""
    check_elastic(cfg)
    limit = cfg.train.max_restarts
    for restart in range(limit + 1):
        started, from_step = time.time(), _checkpoint_step(cfg) if cfg.ckpt.load_enable else 0
        try:
            return run(cfg)
        except ActorDiedError as err:
            if restart == limit:
                raise
            if not _stepped_since(cfg, started, from_step):
                print(f"{err.death} before this start trained a step: not restarting", file=sys.stderr)
                raise
            cfg, where = restarted(cfg)
            print(f"{err.death}; restart {restart + 1} of {limit}, {where}", file=sys.stderr)
            if cfg.train.elastic:
                cfg = fit_to_cluster(cfg)
    raise AssertionError("unreachable")
