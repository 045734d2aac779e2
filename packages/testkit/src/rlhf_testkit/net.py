"""Networking helpers for tests that start servers or process groups on this machine."""

from __future__ import annotations

from rlhf_learner.strategy import free_port

__all__ = ["free_port"]
