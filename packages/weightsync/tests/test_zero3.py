"""A real DeepSpeed ZeRO-3 learner (2 ranks, gloo) syncs to a receiver process: rank 0 sends with
``gather=GatheredParameters`` (one bucket's parameters gathered at a time) while rank 1 takes part in
the same gathers through ``gather_along``; the receiver ends with the fully gathered weights in bf16."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

LEARNER = Path(__file__).with_name("_ds_learner.py")
BUCKET = 16 << 10  # small: the 38 KB / 77 KB weights span several buckets


def test_zero3_learner_sends_gathered_weights_bucket_by_bucket(peers, free_port, tmp_path):
    sync_port, ds_port = free_port(), free_port()
    while ds_port == sync_port:
        ds_port = free_port()
    # generous timeouts: both learners import DeepSpeed before the sender hosts the group
    peers.spawn(transport="gloo", port=sync_port, rank=1, world=2, syncs=1, timeout=300)
    learners = [
        subprocess.Popen(
            [sys.executable, str(LEARNER), json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for cfg in (
            {
                "rank": r,
                "ds_port": ds_port,
                "sync_port": sync_port,
                "bucket_bytes": BUCKET,
                "out": str(tmp_path),
            }
            for r in (0, 1)
        )
    ]
    try:
        logs = [p.communicate(timeout=360)[0] for p in learners]
    finally:
        for p in learners:
            p.kill()
    assert [p.returncode for p in learners] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert peers.join() == [0]
    sent = int(logs[0].split("sent ")[1].split()[0])
    assert sent > 4 and f"gathered along {sent} buckets" in logs[1]
    full, got = torch.load(tmp_path / "full.pt"), peers.result(1, 0)
    assert "error" not in got, got.get("error")
    assert sorted(got["tensors"]) == sorted(full)
    for name, tensor in full.items():
        assert torch.equal(got["tensors"][name], tensor.to(torch.bfloat16)), name
