"""The test-host cluster helper fails at once, naming the node and its output, when a node's
``ray start --block`` has exited (it would otherwise wait its whole timeout for a node that never joins);
its nodes do not wait for their agents to start (a loaded machine starts them slowly)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

import psutil
import pytest
from rlhf_testkit.hosts import Host, RayCluster, ray_cluster, two_hosts


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


AGENTS = ("dashboard/agent.py", "runtime_env/agent/main.py")


def test_a_node_whose_agents_are_frozen_at_start_joins_and_stays(tmp_path):
    """A raylet that waits for its agents' ports dies after 15 s without them (the head's ``ray start``
    failed so on a loaded machine). The test hosts' nodes give the ports: with every agent frozen from its
    start for 25 s, the node joins and is still alive when they wake."""
    frozen: set[int] = set()
    stop = threading.Event()

    def freeze_agents(host: Host) -> None:
        while not stop.is_set():
            for pid in set(host.pids()) - frozen:
                with contextlib.suppress(psutil.Error):
                    if any(a in " ".join(psutil.Process(pid).cmdline()) for a in AGENTS):
                        os.kill(pid, signal.SIGSTOP)
                        frozen.add(pid)
            time.sleep(0.02)

    with two_hosts() as hosts:
        freezer = threading.Thread(target=freeze_agents, args=(hosts[0],), daemon=True)
        freezer.start()
        try:
            with ray_cluster(hosts[:1], cpus=(1,)) as cluster:
                start = time.monotonic()
                while time.monotonic() - start < 25:
                    assert all(p.poll() is None for p in cluster.nodes.values()), "ray start exited"
                    time.sleep(1)
                assert len(frozen) == 2, frozen  # both agents were held all along
                status = cluster.status()
                assert status.returncode == 0 and "1 node_" in status.stdout, status.stdout
        finally:
            stop.set()
            freezer.join(timeout=10)
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
