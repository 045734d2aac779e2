"""Networking helpers for tests that start servers or process groups on this machine."""

from __future__ import annotations

import os

from rlhf_learner.strategy import free_port

__all__ = ["RENDEZVOUS_ENV", "free_port", "without_rendezvous"]

RENDEZVOUS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What a process group set up in this process writes to ``os.environ`` (rlhf-learner's
``init_distributed``, torchrun)."""


def without_rendezvous() -> dict[str, str]:
    """``os.environ`` without :data:`RENDEZVOUS_ENV`: for a child process that forms a group of its own
    (inheriting them, it would bind this process's ``MASTER_PORT``)."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
