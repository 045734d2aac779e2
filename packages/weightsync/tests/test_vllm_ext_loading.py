"""The vLLM worker extension's load path, on plain Python workers (no vLLM imported or started).

A worker without ``reload_weights`` must not fall back to ``model.load_weights`` (which leaves stale
pre-packed weights on vLLM's CPU backend): ``receive_weights`` raises a clear ``RuntimeError``, the
sender's ``send`` raises a ``WeightSyncError`` carrying that reason (no hang), nothing is loaded, and
the group stays in step. A worker with ``reload_weights`` gets exactly the sender's tensors through it.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from rlhf_weightsync import WeightSender, WeightSyncError, vllm_ext
from rlhf_weightsync.vllm_ext import WeightSyncWorkerExtension

TIMEOUT = 20


class TinyModel(torch.nn.Module):
    """Stands in for a vLLM model: has the ``load_weights`` the old fallback called."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = torch.nn.Embedding(11, 4)
        self.proj = torch.nn.Linear(4, 3)
        self.load_weights_calls = 0

    @torch.no_grad()
    def load_weights(self, weights) -> set[str]:
        self.load_weights_calls += 1
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].copy_(tensor)
            loaded.add(name)
        return loaded


class PlainWorker(WeightSyncWorkerExtension):
    """A worker as old vLLM versions had it: a model runner, no ``reload_weights``."""

    def __init__(self) -> None:
        self.model_runner = SimpleNamespace(model=TinyModel(seed=1))


class ReloadingWorker(PlainWorker):
    def __init__(self) -> None:
        super().__init__()
        self.reload_calls: list[dict] = []

    def reload_weights(self, *, weights_iterator, is_checkpoint_format: bool) -> None:
        received = {name: tensor for name, tensor in weights_iterator}
        self.reload_calls.append({"received": received, "is_checkpoint_format": is_checkpoint_format})
        self.model_runner.model.load_weights(received.items())


@pytest.fixture
def no_vllm(monkeypatch):
    """The extension's tensor-parallel rank without importing vLLM; checks vLLM stays unimported."""
    had_vllm = "vllm" in sys.modules
    monkeypatch.setattr(vllm_ext, "_tensor_parallel_rank", lambda: 0)
    yield
    if not had_vllm:
        assert "vllm" not in sys.modules


def join(worker, transport: str, port: int, run_in_thread) -> WeightSender:
    thread, box = run_in_thread(
        worker.init_weight_sync,
        transport=transport,
        master_addr="127.0.0.1",
        master_port=port,
        rank_offset=1,
        world_size=2,
        timeout_s=TIMEOUT,
    )
    sender = WeightSender(
        transport=transport, master_addr="127.0.0.1", master_port=port, world_size=2, timeout_s=TIMEOUT
    )
    thread.join()
    assert "error" not in box, box.get("error")
    return sender


def sync(worker, sender: WeightSender, named, run_in_thread) -> tuple[dict, object]:
    """``(receiver box, send stats or the exception send raised)``."""
    thread, box = run_in_thread(worker.receive_weights, timeout_s=TIMEOUT)
    try:
        sent = sender.send(named)
    except Exception as exc:
        sent = exc
    thread.join(timeout=2 * TIMEOUT)
    assert not thread.is_alive(), "receive_weights hung"
    return box, sent


def learner_weights() -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().clone()) for name, p in TinyModel(seed=2).named_parameters()]


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_worker_without_reload_weights_fails_loudly_and_loads_nothing(
    transport, free_port, run_in_thread, no_vllm
):
    worker = PlainWorker()
    model = worker.model_runner.model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sender = join(worker, transport, free_port(), run_in_thread)
    try:
        for sync_index in range(2):  # the failed sync was drained: the next one is in step, and fails alike
            box, sent = sync(worker, sender, learner_weights(), run_in_thread)
            error = box.get("error")
            assert isinstance(error, RuntimeError), box
            message = str(error)
            assert "PlainWorker" in message
            assert "reload_weights(weights_iterator=..., is_checkpoint_format=True)" in message
            assert "stale" in message and "CPU backend" in message
            assert isinstance(sent, WeightSyncError), sent
            assert f"sync {sync_index} " in str(sent)
            assert "rank 1: RuntimeError: " in str(sent)
            assert "reload_weights(weights_iterator=..., is_checkpoint_format=True)" in str(sent)
            assert model.load_weights_calls == 0  # no silent fallback
            for name, p in model.named_parameters():
                assert torch.equal(p, before[name]), f"{name} changed"
    finally:
        worker.close_weight_sync()
        sender.close()


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_worker_with_reload_weights_gets_the_senders_tensors_through_it(
    transport, free_port, run_in_thread, no_vllm
):
    worker = ReloadingWorker()
    sender = join(worker, transport, free_port(), run_in_thread)
    try:
        named = learner_weights()
        box, sent = sync(worker, sender, named, run_in_thread)
        assert "error" not in box, box.get("error")
        assert not isinstance(sent, Exception), sent
        assert box["value"]["version"] == sent.version == 1
        assert box["value"]["num_tensors"] == len(named)
        [call] = worker.reload_calls
        assert call["is_checkpoint_format"] is True
        received = call["received"]
        assert list(received) == [name for name, _ in named]
        for name, want in named:
            assert torch.equal(received[name], want), name
        for name, p in worker.model_runner.model.named_parameters():
            assert torch.equal(p, dict(named)[name]), name
    finally:
        worker.close_weight_sync()
        sender.close()
