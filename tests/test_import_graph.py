"""No import circle in any package, lazy (function-level) imports included.

Each library module's imports (every ``import`` / ``from ... import`` statement, wherever it stands) are
resolved to modules of the same package; a strongly connected component of more than one module is a
circle. ``if TYPE_CHECKING:`` imports are left out: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_names(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under a package's ``src`` folder."""
    out = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (a package's ``__init__`` counts for ``from pkg import x``
    only when ``x`` is not itself a module)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif base in modules:
                    found.add(base)
    return found - {name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_detector_finds_a_circle_through_a_lazy_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_package_has_an_import_circle():
    found = []
    for src in sorted(ROOT.glob("packages/*/src")):
        modules = module_names(src)
        # a package's __init__ re-exports its modules: edges from it are not circles of the code
        graph = {m: imports_of(m, p, modules) for m, p in modules.items() if p.name != "__init__.py"}
        graph = {m: {d for d in deps if modules[d].name != "__init__.py"} for m, deps in graph.items()}
        found += circles(graph)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


PPO_STAGES = ("experience", "updates", "rewards", "rollout", "evaluation", "pipeline")
"""The stages of a PPO step: each reads its own settings (``rlhf_cli.ppo.settings``), built once by the
recipe, never the configuration tree."""


def reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_ppo_stages_never_import_the_configuration():
    """Not directly, and not through the modules they import (package ``__init__``s included)."""
    src = ROOT / "packages/cli/src"
    modules = module_names(src)
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    config = {m for m in modules if m == "rlhf_cli.config" or m.startswith("rlhf_cli.config.")}
    readers = {stage: sorted(reachable(f"rlhf_cli.ppo.{stage}", graph) & config) for stage in PPO_STAGES}
    assert not any(readers.values()), f"stages that import the configuration: {readers}"
