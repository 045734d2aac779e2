"""``merge_worker_reports``: an engine's workers' reports of one sync become the engine's one report."""

from __future__ import annotations

import pytest
from rlhf_rollout import WeightSyncReport
from rlhf_rollout.vllm_engine import merge_worker_reports


def report(*, seconds: float, version: int = 2) -> WeightSyncReport:
    return WeightSyncReport(
        version=version, num_tensors=5, num_names=6, num_buckets=2, num_bytes=4096, seconds=seconds
    )


def test_one_worker_is_its_own_report():
    one = report(seconds=0.5)
    merged = merge_worker_reports([one])
    assert merged == one and merged is not one


def test_workers_merge_with_the_slowest_seconds():
    merged = merge_worker_reports([report(seconds=0.5), report(seconds=1.5), report(seconds=1.0)])
    assert merged == report(seconds=1.5)


def test_workers_that_disagree_are_reported():
    with pytest.raises(RuntimeError, match=r"worker 1 reports version=3, worker 0 version=2"):
        merge_worker_reports([report(seconds=0.5), report(seconds=0.5, version=3)])


def test_no_reports_is_an_error():
    with pytest.raises(RuntimeError, match="no worker reports"):
        merge_worker_reports([])
