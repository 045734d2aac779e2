"""The weight-sync RPC is defined once (rlhf-rollout's ``WeightSyncRPC``): rlhf-weightsync's worker
extensions implement it and every engine wrapper forwards it with exactly its parameters and return
type (the report: rlhf-rollout's ``WeightSyncReport``, the same TypedDict as rlhf-weightsync's).
Likewise ``TokenGenerator``, what the executors take as their engine."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
import rlhf_rollout
import rlhf_weightsync
from rlhf_rollout import TokenGenerator, WeightSyncRPC
from rlhf_rollout.async_vllm_engine import AsyncEngineActor, AsyncVLLMEngine
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
    AsyncVLLMEngine,  # coroutines: the same parameters, awaited
    AsyncEngineActor,
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


def returns(cls: type, method: str) -> object:
    return typing.get_type_hints(getattr(cls, method))["return"]


def same_typeddict(a: object, b: object) -> bool:
    """Two TypedDicts with the same keys, value types and required keys (what a checker accepts)."""
    hints = typing.get_type_hints
    return hints(a) == hints(b) and a.__required_keys__ == b.__required_keys__  # type: ignore[attr-defined]


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", METHODS)
def test_every_implementation_returns_the_contract_type(cls, method):
    want, got = returns(WeightSyncRPC, method), returns(cls, method)
    assert got is want or (typing.is_typeddict(want) and same_typeddict(got, want)), (got, want)


def test_the_report_is_the_same_on_both_sides_and_matches_sync_stats():
    rollout_report, weightsync_report = rlhf_rollout.WeightSyncReport, rlhf_weightsync.WeightSyncReport
    assert returns(WeightSyncRPC, "receive_weights") is rollout_report
    assert same_typeddict(rollout_report, weightsync_report)
    fields = [f.name for f in dataclasses.fields(rlhf_weightsync.SyncStats)]
    assert fields == list(typing.get_type_hints(rollout_report))
    stats = rlhf_weightsync.SyncStats(
        version=3, num_tensors=2, num_names=3, num_buckets=1, num_bytes=64, seconds=0.5
    )
    assert stats.to_report() == dataclasses.asdict(stats)
    assert rlhf_weightsync.SyncStats.from_report(stats.to_report()) == stats


def test_the_contract_is_keyword_only():
    for method in METHODS:
        assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind, _ in parameters(WeightSyncRPC, method))


@pytest.mark.parametrize("cls", (VLLMEngine, TransformersEngine, EngineClient), ids=lambda c: c.__name__)
def test_engines_and_the_ray_client_are_token_generators(cls):
    """What the executors type their ``engine`` as: each local engine and the Ray client."""
    assert parameters(cls, "generate") == parameters(TokenGenerator, "generate")
    assert isinstance(inspect.getattr_static(cls, "max_model_len"), property)
