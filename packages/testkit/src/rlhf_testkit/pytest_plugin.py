"""Pytest plugin (auto-loaded through the ``pytest11`` entry point).

Fixtures: ``tiny_model_dir`` (a session-wide tiny Qwen2 folder). Markers: ``gpu`` tests are skipped
when CUDA is absent; ``slow`` is registered for end-to-end tests.
"""

from __future__ import annotations

import pytest
from rlhf_cli.demo.tiny_model import TinyModelSpec, build_tiny_model


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped when no CUDA device is present")
    config.addinivalue_line("markers", "slow: end-to-end, takes minutes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Qwen2 causal LM + tokenizer folder, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), TinyModelSpec())
