"""The package's modules import each other without a cycle: the transport contract
(``protocol.py``) depends on nothing in the package, and only the factory (``transport.py``) knows
the concrete transports. Imports inside functions count (grimp reads every import statement);
imports under ``TYPE_CHECKING`` do not (they never run)."""

from __future__ import annotations

import grimp
import pytest

PACKAGE = "rlhf_weightsync"
CONCRETE = ("gloo", "shm", "nccl", "cuda_ipc")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(PACKAGE, exclude_type_checking_imports=True, cache_dir=None)


def find_cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import cycle among the package's modules (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph.modules):
        if module not in state and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_the_package_has_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_protocol_imports_nothing_from_the_package(graph):
    assert graph.find_modules_directly_imported_by(f"{PACKAGE}.protocol") == set()


def test_only_the_factory_imports_the_concrete_transports(graph):
    for name in CONCRETE:
        importers = graph.find_modules_that_directly_import(f"{PACKAGE}.{name}")
        assert importers <= {f"{PACKAGE}.transport", f"{PACKAGE}.cuda_ipc"}, (name, importers)
    for name in (*CONCRETE, "_collective", "_slots", "_shmfile", "_rendezvous"):
        assert not graph.chain_exists(f"{PACKAGE}.{name}", f"{PACKAGE}.transport"), name


def test_the_finder_reports_a_cycle():
    """The check above can fail: a graph with a cycle is reported, path and all."""
    g = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a")):
        g.add_import(importer=a, imported=b)
    assert find_cycle(g) == ["p.a", "p.b", "p.c", "p.a"]
