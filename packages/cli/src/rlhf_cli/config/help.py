"""``--help`` for a configuration tree: one table per namespace, each flag with type, default and doc."""

from __future__ import annotations

import collections.abc
import io
import types
import typing
from typing import Any

from rlhf_cli.config.loading import iter_fields
from rlhf_cli.config.run import LEARNER_FIELDS_SET_ELSEWHERE

__all__ = ["render_help", "set_elsewhere", "type_name"]


def type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        parts = [type_name(a) for a in typing.get_args(annotation) if a is not type(None)]
        return (
            " | ".join(parts) + " (optional)"
            if len(parts) < len(typing.get_args(annotation))
            else " | ".join(parts)
        )
    if origin in (list, tuple, typing.Sequence, collections.abc.Sequence):
        args = typing.get_args(annotation)
        return f"list[{type_name(args[0])}]" if args else "list"
    return getattr(annotation, "__name__", str(annotation)).replace("Path", "path")


def render_help(cls: type, *, command: str, description: str, options: list[tuple[str, str]]) -> str:
    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=120, file=io.StringIO())  # rendered once, by the caller
    console.print(f"[bold]Usage:[/bold] {command} [OPTIONS] [--section.key VALUE ...]\n")
    console.print(description.replace("``", "") + "\n")
    opts = Table(title="options", title_justify="left", show_header=False, box=None)
    for flag, doc in options:
        opts.add_row(f"[cyan]{flag}[/cyan]", doc)
    console.print(opts)
    console.print("Flags override --config; values are YAML scalars; list flags repeat or take a,b,c.\n")
    fields = [f for f in iter_fields(cls) if not set_elsewhere(f.path)]
    common = [f for path in getattr(cls, "common_flags", ()) for f in fields if f.path == path]
    tables = {"common": _table("common flags (every flag, by section, below)")} if common else {}
    for f in common:
        _add_row(tables["common"], f)
    for f in fields:
        ns = f.path.split(".")[0]
        if ns not in tables:
            tables[ns] = _table(f"--{ns}.*")
        _add_row(tables[ns], f)
    for table in tables.values():
        console.print(table)
    return console.export_text()


def set_elsewhere(path: str) -> bool:
    """A ``--learner`` field that each group takes from its own flag (not shown)."""
    section, _, key = path.partition(".")
    return section == "learner" and key in LEARNER_FIELDS_SET_ELSEWHERE


def _table(title: str) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("flag", no_wrap=True)  # a flag is copied whole, never split over lines
    for col in ("type", "default", "description"):
        table.add_column(col, overflow="fold")
    return table


def _add_row(table: Any, f: Any) -> None:
    default = "-" if f.default is None else str(f.default)
    doc = f.doc.replace("``", "")  # reStructuredText literals read as plain text in a terminal
    table.add_row(f"--{f.path}", type_name(f.annotation), default, doc)
