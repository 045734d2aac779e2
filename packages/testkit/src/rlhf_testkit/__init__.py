"""Offline test kit: pytest fixtures and markers, and small test helpers. The tiny model builder lives in
rlhf-cli (``rlhf_cli.demo.tiny_model``, the ``rlhf tiny-model`` command) and is re-exported here."""

from rlhf_cli.demo.tiny_model import CHAT_TEMPLATE, TinyModelSpec, build_tiny_model, build_tokenizer

from rlhf_testkit.net import free_port
from rlhf_testkit.processes import ListeningSocket, SocketWatcher, is_loopback, listening_sockets

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
