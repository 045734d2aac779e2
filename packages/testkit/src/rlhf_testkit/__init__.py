"""Offline test kit: pytest fixtures and markers, and small test helpers. The tiny model builder lives in
rlhf-cli (``rlhf_cli.demo.tiny_model``, the ``rlhf tiny-model`` command) and is re-exported here.

The names are imported when first used, so that loading the pytest plugin imports no torch: the plugin
sets how long idle OpenMP threads spin before torch loads OpenMP (``pytest_plugin``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlhf_cli.demo.tiny_model import CHAT_TEMPLATE, TinyModelSpec, build_tiny_model, build_tokenizer

    from rlhf_testkit.net import free_port
    from rlhf_testkit.processes import ListeningSocket, SocketWatcher, is_loopback, listening_sockets

_WHERE = {
    **dict.fromkeys(
        ("CHAT_TEMPLATE", "TinyModelSpec", "build_tiny_model", "build_tokenizer"), "rlhf_cli.demo.tiny_model"
    ),
    "free_port": "rlhf_testkit.net",
    **dict.fromkeys(
        ("ListeningSocket", "SocketWatcher", "is_loopback", "listening_sockets"), "rlhf_testkit.processes"
    ),
}

__all__ = [
    "CHAT_TEMPLATE",
    "ListeningSocket",
    "SocketWatcher",
    "TinyModelSpec",
    "build_tiny_model",
    "build_tokenizer",
    "free_port",
    "is_loopback",
    "listening_sockets",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rlhf_testkit' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
