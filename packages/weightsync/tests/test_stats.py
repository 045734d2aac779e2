"""``SyncStats`` is a plain dataclass that pickles as itself (so it crosses Ray), and its plain-dict
``WeightSyncReport`` (what ``receive_weights`` returns) round-trips."""

from __future__ import annotations

import dataclasses
import pickle
import typing

import pytest
from rlhf_weightsync import SyncStats, WeightSyncReport

STATS = SyncStats(version=7, num_tensors=3, num_names=4, num_buckets=2, num_bytes=1536, seconds=0.25)


@pytest.mark.parametrize("dumps", [pickle.dumps, pytest.importorskip("cloudpickle").dumps])
def test_sync_stats_pickles_as_itself(dumps):
    back = pickle.loads(dumps(STATS))
    assert type(back) is SyncStats and back == STATS
    assert back.gb_per_s == pytest.approx(1536 / 0.25 / 1e9)


def test_the_report_has_the_stats_fields_and_builtin_values():
    assert list(typing.get_type_hints(WeightSyncReport)) == [f.name for f in dataclasses.fields(SyncStats)]
    report = STATS.to_report()
    assert type(report) is dict and report == dataclasses.asdict(STATS)
    assert all(type(v) in (int, float) for v in report.values())
    assert SyncStats.from_report(report) == STATS


def test_a_report_with_other_keys_is_refused():
    with pytest.raises(TypeError):
        SyncStats.from_report({**STATS.to_report(), "rank": 1})
    with pytest.raises(TypeError):
        SyncStats.from_report({"version": 1})
