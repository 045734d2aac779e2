"""The backends are seams: no module outside a backend's own branches on a backend's name.

Every training and rollout backend registers itself (``rlhf_learner.strategy.TRAINING_BACKENDS``,
``rlhf_rollout.backends.ROLLOUT_BACKENDS``); the config, the plan, the recipes and the other libraries
ask the registry what a backend can do. This test reads every library module and fails on a comparison
with a backend's name (``==``, ``!=``, ``in``, ``match``) or a ``Literal[...]`` of backend names outside
the backends' own modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OWN_MODULES = {
    "packages/rollout/src/rlhf_rollout/backends/vllm.py",
    "packages/rollout/src/rlhf_rollout/backends/transformers.py",
    "packages/rollout/src/rlhf_rollout/vllm_engine.py",
    "packages/rollout/src/rlhf_rollout/async_vllm_engine.py",
    "packages/rollout/src/rlhf_rollout/hf_engine.py",
    "packages/learner/src/rlhf_learner/strategy/strategy.py",
    "packages/learner/src/rlhf_learner/strategy/fsdp2.py",
}
"""The backends' own modules: each may name itself."""


def backend_names() -> set[str]:
    from rlhf_learner.strategy import TRAINING_BACKENDS
    from rlhf_rollout.backends import ROLLOUT_BACKENDS

    return set(TRAINING_BACKENDS) | set(ROLLOUT_BACKENDS) | {"vllm-cpu"}


def _names_in(node: ast.AST, names: set[str]) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names]


def branches_on_names(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` for each comparison with, ``match`` case on, or ``Literal`` of a backend name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        operands: list[ast.AST] = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.match_case):
            operands = [node.pattern]
        elif (
            isinstance(node, ast.Subscript)
            and getattr(node.value, "id", getattr(node.value, "attr", "")) == "Literal"
        ):
            operands = [node.slice]
        for op in operands:
            found += [
                (node.lineno if hasattr(node, "lineno") else op.lineno, n) for n in _names_in(op, names)
            ]
    return found


def test_the_detector_finds_each_form_of_branching():
    names = {"vllm", "fsdp2"}
    code = (
        "if backend == 'vllm': pass\n"
        "x = b in ('fsdp2', 'other')\n"
        "B = Literal['vllm', 'x']\n"
        "match b:\n    case 'fsdp2': pass\n"
        "y = {'vllm': 1}[b]\n"  # a lookup, not a branch: allowed
    )
    assert [n for _, n in branches_on_names(code, names)] == ["vllm", "fsdp2", "vllm", "fsdp2"]


def test_no_library_module_outside_a_backend_branches_on_a_backend_name():
    names = backend_names()
    assert {"deepspeed", "fsdp2", "vllm", "transformers"} <= names
    offenders = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in OWN_MODULES:
            continue
        offenders += [f"{rel}:{line}: {name!r}" for line, name in branches_on_names(path.read_text(), names)]
    assert not offenders, "branches on a backend's name (ask its registry instead):\n" + "\n".join(offenders)
