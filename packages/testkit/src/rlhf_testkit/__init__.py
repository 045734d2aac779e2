"""Offline test kit: a tiny causal LM and tokenizer, built locally with no hub access."""

from rlhf_testkit.net import free_port
from rlhf_testkit.tiny_model import CHAT_TEMPLATE, TinyModelSpec, build_tiny_model, build_tokenizer

__all__ = ["CHAT_TEMPLATE", "TinyModelSpec", "build_tiny_model", "build_tokenizer", "free_port"]
