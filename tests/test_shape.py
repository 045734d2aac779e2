"""The shape rules every package keeps: no source file over 400 lines, no function over 60 (decorators
included), so a module stays one family and a function one screen."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCES = sorted((Path(__file__).resolve().parents[1] / "packages").glob("*/src/**/*.py"))
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def _long_functions(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                out.append(f"{path}:{node.lineno} {node.name} ({node.end_lineno - start + 1} lines)")
    return out


def test_the_sources_were_found():
    assert len(SOURCES) > 50


def test_no_source_file_is_over_400_lines():
    long = [f"{p} ({n} lines)" for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, long


def test_no_function_is_over_60_lines():
    long = [f for p in SOURCES for f in _long_functions(p)]
    assert not long, long
