"""The test-host cluster helper fails at once, naming the node and its output, when a node's
``ray start --block`` has exited (it would otherwise wait its whole timeout for a node that never joins)."""

from __future__ import annotations

import subprocess
import time

import pytest
from rlhf_testkit.hosts import Host, RayCluster


def test_waiting_for_nodes_stops_at_once_when_a_node_has_exited(tmp_path):
    host = Host(namespace="rlhf-test-b", ip="10.213.0.2")
    cluster = RayCluster(hosts=(host,), address="10.213.0.1:6379", env={}, temp_dir=str(tmp_path))
    cluster.node_log(host).write_text("ray start: could not reach the head\n")
    logs = tmp_path / "session_latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "raylet.1.out").write_text(
        "[2026-12-03 03:39:05,601 I 1 1] (raylet) main.cc:283: started\n  detail\n"
    )
    cluster.nodes[host.namespace] = subprocess.Popen(["sh", "-c", "exit 3"])
    cluster.nodes[host.namespace].wait(timeout=30)
    start = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"rlhf-test-b stopped(?s:.*)exited 3: ray start: could not reach"
    ) as e:
        cluster.wait_for_nodes(2, timeout_s=300)
    assert str(e.value).endswith(
        "\nraylet.1.out: [2026-12-03 03:39:05,601 I 1 1] (raylet) main.cc:283: started"
    )
    assert time.monotonic() - start < 5
