"""The test-host cluster helper fails at once, naming the node and its output, when a node's
``ray start --block`` has exited (it would otherwise wait its whole timeout for a node that never joins);
its nodes start on a loaded machine."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from rlhf_testkit.hosts import Host, RayCluster, _threads, ray_cluster, two_hosts


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


def test_a_node_starts_on_a_core_loaded_past_its_share_and_then_runs_at_normal_priority():
    """A test host's Ray node starting on one core beside six busy processes, each in a session of its
    own (the kernel shares the cores between sessions): a raylet whose agents take over 15 s to start
    exits (the two-host set-up failures). The node starts at a higher priority, joins, and every thread in
    the host is back at this process's priority once it has. (One core: the other test process keeps the
    other.)"""
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})  # this thread's: inherited by what it starts
        with two_hosts() as hosts:
            loop = hosts[1].command(["sh", "-c", "while :; do :; done"])  # (killed with the hosts)
            hogs = [subprocess.Popen(loop, start_new_session=True) for _ in range(6)]
            with ray_cluster(hosts[:1], cpus=(1,)) as cluster:
                hosts[1].kill_all()
                for h in hogs:
                    h.wait(timeout=30)
                status = cluster.status(raised=True)  # (a probe not starved by the other tests)
                assert status.returncode == 0 and "1 node_" in status.stdout, status.stdout
                threads = [t for pid in hosts[0].pids() for t in _threads(pid)]
                mine = os.getpriority(os.PRIO_PROCESS, 0)
                assert len(threads) > 10 and {os.getpriority(os.PRIO_PROCESS, t) for t in threads} == {mine}
                (node,) = cluster.nodes.values()
                autogroup = Path(f"/proc/{node.pid}/autogroup")
                assert not autogroup.exists() or autogroup.read_text().split()[-1] == "0"
    finally:
        os.sched_setaffinity(0, allowed)
