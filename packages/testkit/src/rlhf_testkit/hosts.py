"""Real test hosts on one machine, and a Ray cluster across them.

A host is a Linux network namespace with a network stack of its own: its loopback and one end of a veth
link to the other host, with its own address (``10.213.0.1``, ``10.213.0.2``). A process started in a
host sees only those interfaces, so every byte between hosts crosses the link; the filesystem (and so
a run folder) is shared, as a cluster's shared folder would be. Needs root and iproute2's ``ip``.

:func:`ray_cluster` starts ``ray start --head`` in the first host and ``ray start --address`` in the
others, each node on its host's address, Ray's token authentication on with a fresh token: its
:attr:`RayCluster.env` is what a client (``ray status``, an ``rlhf`` driver) needs to join.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Host", "RayCluster", "ray_cluster", "two_hosts"]

LINK = "veth0"
"""Each host's end of the link (the same name in both namespaces)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    """One test host: a network namespace and its address on the link."""

    namespace: str
    ip: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def holds(self, pid: int) -> bool:
        """Whether process ``pid`` runs in this host (its network namespace is this host's)."""
        try:
            return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{self.namespace}").st_ino
        except OSError:
            return False

    def pids(self) -> list[int]:
        """The processes running in this host."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.namespace], capture_output=True, text=True, timeout=30
        )
        return [int(p) for p in out.stdout.split()]

    def kill_all(self, timeout_s: float = 30.0) -> None:
        """SIGKILL every process in this host; returns once none is left."""
        deadline = time.monotonic() + timeout_s
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {self.namespace}: processes {pids} survived SIGKILL")
            time.sleep(0.1)

    def set_link(self, up: bool) -> None:
        _ip("-n", self.namespace, "link", "set", LINK, "up" if up else "down")

    def power_off(self) -> None:
        """As a host that loses power: its link goes dark first (no peer hears a connection close), then
        every process in it dies."""
        self.set_link(False)
        self.kill_all()


@contextlib.contextmanager
def two_hosts(subnet: str = "10.213.0") -> Iterator[tuple[Host, Host]]:
    """Two hosts joined by a veth link, ``{subnet}.1`` and ``{subnet}.2`` (/24). On the way out every
    process in them is killed and the namespaces are deleted (their link with them)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise RuntimeError("test hosts need root and iproute2's ip (apt-get install iproute2)")
    _remove_stale_hosts()
    tag = f"rlhf{os.getpid()}x{secrets.token_hex(2)}"
    hosts = (Host(f"{tag}a", f"{subnet}.1"), Host(f"{tag}b", f"{subnet}.2"))
    made: list[Host] = []
    try:
        for h in hosts:
            _ip("netns", "add", h.namespace)
            made.append(h)
            _ip("-n", h.namespace, "link", "set", "lo", "up")
        a, b = hosts
        _ip(
            "link",
            "add",
            LINK,
            "netns",
            a.namespace,
            "type",
            "veth",
            "peer",
            "name",
            LINK,
            "netns",
            b.namespace,
        )
        for h in hosts:
            _ip("-n", h.namespace, "addr", "add", f"{h.ip}/24", "dev", LINK)
            h.set_link(True)
        yield hosts
    finally:
        for h in made:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                h.kill_all()
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", h.namespace)


def _remove_stale_hosts() -> None:
    """Hosts that a killed test process left (named ``rlhf<pid>x...``, that pid gone): their processes
    killed, their namespaces deleted."""
    for name in os.listdir("/run/netns") if os.path.isdir("/run/netns") else ():
        pid = name.removeprefix("rlhf").split("x", 1)[0]
        if name.startswith("rlhf") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                Host(name, "").kill_all()
                _ip("netns", "del", name)


FAST_HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "10000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "3000",
    "RAY_health_check_failure_threshold": "5",
}
"""The head marks a silent node dead after 5 missed checks, each given 3 s and sent a second after the last
answer or timeout: about 20 s after it went silent (Ray's defaults: about a minute). A node is first checked
10 s after it registers, and a raylet starved for up to ~15 s on a loaded machine is not taken for a lost
host: with 4 checks of 2 s, a head raylet frozen for 12 s was marked dead and took its cluster down."""


START_NICE = -15
"""How many nice levels each node's ``ray start`` and the processes of its session (its raylet, GCS,
agents: one scheduler autogroup where the kernel groups by session) run above the test process until
the nodes have joined (:meth:`RayCluster.wait_for_nodes`), when they are set back to its level. A
raylet waits for its agents (Python processes) to report their ports and exits after 15 s without them
(``ray start`` itself waits 30 s for its raylet). On a 2-core machine loaded by other tests, the
head's half-dozen Python processes shared one session's share of the cores, the agents took longer, and
the node never came up. A test host is a machine of its own: its node starts as it would on an idle one."""


def _write_autogroup_nice(session: int, nice: int) -> None:
    """The nice of session leader ``session``'s scheduler autogroup (nothing where the kernel has none)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{session}/autogroup").write_text(str(nice))


def _raise_session(leader: int) -> None:
    """Session ``leader``, just started (one thread; what it starts inherits its priority), and its
    scheduler autogroup at :data:`START_NICE` above this process."""
    _write_autogroup_nice(leader, START_NICE)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, leader, max(-20, os.getpriority(os.PRIO_PROCESS, 0) + START_NICE))


def _lower_session(session: int, nice: int) -> None:
    """Every thread of every process in session ``session`` that runs above ``nice`` (a lower nice) set to
    it; pass after pass until none is left (threads start lazily)."""
    for _ in range(10):
        above = [t for pid in _session_pids(session) for t in _threads(pid) if _nice(t) < nice]
        if not above:
            return
        for tid in above:
            with contextlib.suppress(OSError):  # (gone since)
                os.setpriority(os.PRIO_PROCESS, tid, nice)


def _nice(tid: int) -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:  # gone
        return 19


def _session_pids(session: int) -> list[int]:
    out = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            if os.getsid(pid) == session:
                out.append(pid)
    return out


@dataclass
class RayCluster:
    """A Ray cluster whose nodes are test hosts (:func:`ray_cluster`)."""

    hosts: tuple[Host, ...]
    address: str
    """The head's GCS address, ``ip:port``."""
    env: dict[str, str]
    """The environment a client needs: token authentication on, with the cluster's token."""
    temp_dir: str
    nodes: dict[str, subprocess.Popen] = field(default_factory=dict)
    """Host namespace -> its ``ray start --block`` process."""
    raised: set[int] = field(default_factory=set)
    """The sessions of nodes started at :data:`START_NICE` and not yet set back."""

    def start_node(
        self, host: Host, *, num_cpus: int, head: bool = False, extra_env: dict | None = None
    ) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        port = self.address.rsplit(":", 1)[1]
        where = (
            ["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
            if head
            else [f"--address={self.address}"]
        )
        argv = [ray, "start", "--block", f"--node-ip-address={host.ip}", f"--num-cpus={num_cpus}", *where]
        with self.node_log(host).open("wb") as log:  # its end goes into wait_for_nodes' error
            self.nodes[host.namespace] = subprocess.Popen(
                host.command(argv),
                env={**self.env, **(extra_env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        session = self.nodes[host.namespace].pid  # (its leader: Popen returns once it has exec'd)
        _raise_session(session)
        self.raised.add(session)

    def power_on(self, host: Host, *, num_cpus: int) -> None:
        """A host that was powered off, back: its link up, its node started again, and joined."""
        host.set_link(True)
        self.start_node(host, num_cpus=num_cpus)
        self.wait_for_nodes(len(self.hosts))

    def node_log(self, host: Host) -> Path:
        """The output of ``host``'s ``ray start`` (in the cluster's folder)."""
        return Path(self.temp_dir) / f"start-{host.namespace}.log"

    def status(
        self, env: dict[str, str] | None = None, *, raised: bool = False
    ) -> subprocess.CompletedProcess:
        """``ray status`` from the head's host; ``raised``: in a session of its own at :data:`START_NICE`,
        as the starting nodes (a Python process that shares this process's share of a loaded core can
        take minutes to import Ray). Raises :class:`subprocess.TimeoutExpired` after 60 s."""
        ray = str(Path(sys.executable).parent / "ray")
        argv = self.hosts[0].command([ray, "status", f"--address={self.address}"])
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        with subprocess.Popen(argv, env=env or self.env, start_new_session=raised, **pipes) as proc:
            if raised:
                _raise_session(proc.pid)
            try:
                out, err = proc.communicate(timeout=60)
            except BaseException:  # (a timeout, or the test interrupted): it goes too
                proc.kill()
                raise
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def wait_for_nodes(self, n: int, timeout_s: float = 300.0) -> None:
        """Until ``n`` nodes are alive (on a loaded 2-core machine a node can take minutes to join). The
        nodes' ``ray start`` output is read until each says it started (a file read); only then is the
        head asked (``ray status``: seconds of CPU, which a starting node needs more)."""
        deadline = time.monotonic() + timeout_s
        while True:
            exited = [ns for ns, p in self.nodes.items() if p.poll() is not None]
            if exited:  # its `ray start --block` ended: that node will never join
                raise RuntimeError(
                    f"the Ray cluster will not reach {n} nodes: {', '.join(exited)} stopped"
                    f"{self._node_states()}"
                )
            done = subprocess.CompletedProcess([], 1, "", "a node's ray start has not said it started")
            if self._started():
                try:
                    done = self.status(raised=True)
                except subprocess.TimeoutExpired:  # (a head that does not answer yet)
                    done = subprocess.CompletedProcess([], -9, "", "ray status: no answer in 60 s")
            if done.returncode == 0 and _active_nodes(done.stdout) == n:
                self._back_to_normal_priority()
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Ray cluster did not reach {n} nodes in {timeout_s:.0f} s: "
                    f"{done.stdout[-500:]}{done.stderr[-500:]}{self._node_states()}"
                )
            time.sleep(0.5)

    def _started(self) -> bool:
        """Whether each node's ``ray start`` has printed that its runtime started."""
        logs = [self.node_log(h) for h in self.hosts if h.namespace in self.nodes]
        return all(p.is_file() and "Ray runtime started" in p.read_text(errors="replace") for p in logs)

    def _back_to_normal_priority(self) -> None:
        """Each raised node's session back at this process's priority (its autogroup at 0)."""
        while self.raised:
            session = self.raised.pop()
            _write_autogroup_nice(session, 0)
            _lower_session(session, os.getpriority(os.PRIO_PROCESS, 0))

    def _node_states(self) -> str:
        """Each node's ``ray start``: running or its exit status, and the end of its output (the folder
        holding it goes with the cluster)."""
        hosts = {h.namespace: h for h in self.hosts}
        out = []
        for ns, p in self.nodes.items():
            state = "running" if p.poll() is None else f"exited {p.returncode}"
            log = self.node_log(hosts[ns])
            tail = log.read_text(errors="replace")[-400:] if log.is_file() else ""
            out.append(f"\n{ns}: ray start {state}: {tail}")
        logs = Path(self.temp_dir) / "session_latest" / "logs"  # every node's (workers: raylet.1.out, ...)
        names = [*sorted(logs.glob("raylet*.out")), logs / "dashboard_agent.log", logs / "gcs_server.out"]
        for path in names:
            text = path.read_text(errors="replace") if path.is_file() else ""
            lines = [line[:300] for line in text.splitlines() if line.startswith(("[20", "20"))][-6:]
            if lines:  # its last timestamped lines (a stack trace's header line among them)
                out.append(f"\n{path.name}: " + "\n".join(lines))
        return "".join(out)

    def stop(self) -> None:
        """Every node stopped (SIGKILL to everything in each host, the head's last)."""
        for h in reversed(self.hosts):
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                h.kill_all()
        for p in self.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _threads(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (none if it has exited)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _active_nodes(status: str) -> int:
    """The number of nodes ``ray status`` lists as active."""
    lines = status.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Active:")
    except StopIteration:
        return 0
    count = 0
    for line in lines[start + 1 :]:
        if not line.strip().startswith("1 node_"):
            break
        count += 1
    return count


@contextlib.contextmanager
def ray_cluster(
    hosts: Sequence[Host], *, cpus: Sequence[int], port: int = 6380, health_checks: dict | None = None
) -> Iterator[RayCluster]:
    """A Ray node in each host (the head in ``hosts[0]``), ``cpus[i]`` CPUs on host ``i``, token
    authentication on (a fresh token). ``health_checks``: the head's node health-check settings
    (default :data:`FAST_HEALTH_CHECKS`, so that a lost host is noticed in about 20 s). The nodes start at
    :data:`START_NICE` and are set back once they have joined."""
    inherited = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}  # another host's interface
    env = {
        **inherited,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",  # 0 would refuse a second node
    }
    temp = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cluster = RayCluster(hosts=tuple(hosts), address=f"{hosts[0].ip}:{port}", env=env, temp_dir=temp)
    try:
        cluster.start_node(
            hosts[0],
            num_cpus=cpus[0],
            head=True,
            extra_env=FAST_HEALTH_CHECKS if health_checks is None else health_checks,
        )
        for host, n in zip(hosts[1:], cpus[1:], strict=True):  # (they wait for the head to come up)
            cluster.start_node(host, num_cpus=n)
        cluster.wait_for_nodes(len(hosts))
        yield cluster
    finally:
        cluster.stop()
