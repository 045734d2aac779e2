"""Pytest plugin (auto-loaded through the ``pytest11`` entry point).

Fixtures: ``tiny_model_dir`` (a session-wide tiny Qwen2 folder); ``two_host_ray`` (a module's Ray cluster
across two test hosts, network namespaces on a veth link: ``rlhf_testkit.hosts``); ``shared_processes``
(hands what a test starts to a shared fixture). Markers: ``gpu`` tests are skipped
when CUDA is absent, and run one at a time across the suite's processes (``gpu_lock``: they compare the
device's free memory, and share one GPU); ``slow`` marks tests that take about a minute or more, and the
files with the most of them run first (``slow_files_first``).

Every test is checked for processes it leaves behind, orphans included (``leftovers``): a test that
started a process which is still running 30 s after the test (and its fixtures of the same scope) ended
fails at teardown, naming the processes. Fixtures shared by several tests are checked the same way at
the end of their module and of the session.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from rlhf_cli.demo.tiny_model import TinyModelSpec, build_tiny_model

from rlhf_testkit.leftovers import become_subreaper, descendants, leftovers

GRACE_S = 30.0
_SESSION_OWNED = pytest.StashKey[set]()
"""Processes that session-wide fixtures started (a Ray cluster): they outlive modules by design."""
_SHARED = pytest.StashKey[set]()
"""Processes that session- or module-wide fixtures started: they outlive tests by design (a test may set
such a fixture up late, e.g. through ``request.getfixturevalue``)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped when no CUDA device is present")
    config.addinivalue_line("markers", "slow: takes about a minute or more (end-to-end runs, mostly)")
    become_subreaper()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_files_first(items)
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


def slow_files_first(items: list[pytest.Item]) -> None:
    """Order the tests file by file, the files with the most ``slow`` tests first (in place; a stable sort,
    each file's tests kept together and in order). pytest-xdist's ``--dist loadfile`` hands files out in
    this order (with ``--no-loadscope-reorder``), so the longest start first and the short ones fill the
    end: the longest-first rule, which keeps a process from running one long file alone at the end."""
    slow: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        path = item.nodeid.split("::", 1)[0]
        first.setdefault(path, i)
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: (-slow[p := item.nodeid.split("::", 1)[0]], first[p]))


GPU_LOCK = Path(tempfile.gettempdir()) / "rlhf-testkit-gpu.lock"
"""Held by the process running a ``gpu`` test (pytest-xdist runs test files in several processes)."""


@contextlib.contextmanager
def gpu_lock(path: Path = GPU_LOCK) -> Iterator[None]:
    """Exclusive across processes (and open files) for the body: one ``gpu`` test at a time."""
    import fcntl

    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A ``gpu`` test's set-up, call and teardown (module fixtures it starts or ends included) hold
    ``gpu_lock``; a skipped one does not wait."""
    if not item.get_closest_marker("gpu") or item.get_closest_marker("skip"):
        return (yield)
    with gpu_lock():
        return (yield)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Qwen2 causal LM + tokenizer folder, built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), TinyModelSpec())


@pytest.fixture(scope="module")
def two_host_ray():
    """A Ray cluster across two test hosts (``rlhf_testkit.hosts.RayCluster``): the head on host A
    (10.213.0.1, 1 CPU), a worker node on host B (10.213.0.2, 2 CPUs), token authentication on. Needs
    root and iproute2 (refused with a clear error otherwise, never skipped)."""
    from rlhf_testkit.hosts import ray_cluster, two_hosts

    with two_hosts() as hosts, ray_cluster(hosts, cpus=(1, 2)) as cluster:
        yield cluster


@pytest.fixture
def shared_processes(request: pytest.FixtureRequest) -> Callable[[], AbstractContextManager[None]]:
    """``with shared_processes():`` in a test: the processes started inside belong to a shared fixture
    (e.g. a node the test starts again in the module's cluster, which the cluster stops), so the test's
    leftover check leaves them to that fixture's."""

    @contextlib.contextmanager
    def adopted() -> Iterator[None]:
        before = descendants()
        try:
            yield
        finally:
            request.config.stash.setdefault(_SHARED, set()).update(descendants() - before)

    return adopted


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    if fixturedef.scope == "function":
        return (yield)
    before = descendants()
    result = yield
    started = descendants() - before
    request.config.stash.setdefault(_SHARED, set()).update(started)
    if fixturedef.scope == "session":
        request.config.stash.setdefault(_SESSION_OWNED, set()).update(started)
    return result


def _check_leftovers(before, what: str) -> None:
    left = leftovers(before, grace_s=GRACE_S)
    if left:
        pytest.fail(f"{what} left {len(left)} process(es) running: " + "; ".join(map(str, left)), False)


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes_after_the_session():
    before = descendants()
    yield
    _check_leftovers(before, "the session's shared fixtures")


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_processes_after_the_module(request: pytest.FixtureRequest):
    before = descendants()
    yield
    owned = request.config.stash.get(_SESSION_OWNED, set())
    _check_leftovers(before | owned, f"module {request.module.__name__}'s fixtures")


@pytest.fixture(autouse=True)
def _no_leftover_processes(request: pytest.FixtureRequest):
    before = descendants()
    yield
    _check_leftovers(before | request.config.stash.get(_SHARED, set()), "the test")
