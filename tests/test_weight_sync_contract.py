"""The weight-sync RPC is defined once (rlhf-rollout's ``WeightSyncRPC``): rlhf-weightsync's worker
extensions implement it and every engine wrapper forwards it with exactly its parameters. Likewise
``TokenGenerator``, what the executors take as their engine."""

from __future__ import annotations

import inspect

import pytest
from rlhf_rollout import TokenGenerator, WeightSyncRPC
from rlhf_rollout.hf_engine import TransformersEngine
from rlhf_rollout.ray_engines import EngineActor, EngineClient
from rlhf_rollout.vllm_engine import VLLMEngine
from rlhf_weightsync.module_ext import ModuleWeightSyncExtension
from rlhf_weightsync.vllm_ext import WeightSyncWorkerExtension

METHODS = ("init_weight_sync", "receive_weights", "close_weight_sync")
IMPLEMENTATIONS = (
    WeightSyncWorkerExtension,
    ModuleWeightSyncExtension,
    VLLMEngine,
    TransformersEngine,
    EngineActor,
)


def parameters(cls: type, method: str) -> list[tuple[str, object, object]]:
    sig = inspect.signature(getattr(cls, method))
    # Ray adds a private _ray_trace_ctx keyword to the methods of classes it has made actors of
    return [
        (p.name, p.kind, p.default)
        for p in sig.parameters.values()
        if p.name != "self" and not p.name.startswith("_ray")
    ]


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", METHODS)
def test_every_implementation_has_the_contract_signature(cls, method):
    assert parameters(cls, method) == parameters(WeightSyncRPC, method)


def test_the_contract_is_keyword_only():
    for method in METHODS:
        assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in parameters(WeightSyncRPC, method))


@pytest.mark.parametrize("cls", (VLLMEngine, TransformersEngine, EngineClient), ids=lambda c: c.__name__)
def test_engines_and_the_ray_client_are_token_generators(cls):
    """What the executors type their ``engine`` as: each local engine and the Ray client."""
    assert parameters(cls, "generate") == parameters(TokenGenerator, "generate")
    assert isinstance(inspect.getattr_static(cls, "max_model_len"), property)
