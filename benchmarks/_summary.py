"""The rows every benchmark can append to a summary file (``--summary FILE``): tab-separated
``check, result, target, pass?``, the table that ``run_all.py`` and ``gpu_check.sh`` print."""

from __future__ import annotations

import argparse


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--summary",
        default=None,
        help="append tab-separated rows (check, result, target, pass?) to this file",
    )


def row(path: str | None, check: str, result: str, target: str, passed: str) -> None:
    """Append one row (nothing without ``path``)."""
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write("\t".join(s.replace("\t", " ") for s in (check, result, target, passed)) + "\n")


def ratio_row(path: str | None, check: str, ratio: float, target: float | None, detail: str = "") -> None:
    """A ratio against its target (``>= target`` passes; ``None``: reported only)."""
    result = f"{ratio:.2f}x" + (f" ({detail})" if detail else "")
    if target is None:
        row(path, check, result, "-", "-")
    else:
        row(path, check, result, f">= {target:g}x", "yes" if ratio >= target else "NO")
