"""``--help`` for a configuration tree: one table per namespace, each flag with type, default and doc."""

from __future__ import annotations

import collections.abc
import io
import types
import typing
from typing import Any

from rlhf_cli.config.loading import iter_fields
from rlhf_cli.config.run import LEARNER_FIELDS_SET_ELSEWHERE

__all__ = ["render_help"]


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        parts = [_type_name(a) for a in typing.get_args(annotation) if a is not type(None)]
        return (
            " | ".join(parts) + " (optional)"
            if len(parts) < len(typing.get_args(annotation))
            else " | ".join(parts)
        )
    if origin in (list, tuple, typing.Sequence, collections.abc.Sequence):
        args = typing.get_args(annotation)
        return f"list[{_type_name(args[0])}]" if args else "list"
    return getattr(annotation, "__name__", str(annotation)).replace("Path", "path")


def render_help(cls: type, *, command: str, description: str, options: list[tuple[str, str]]) -> str:
    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=120, file=io.StringIO())  # rendered once, by the caller
    console.print(f"[bold]Usage:[/bold] {command} [OPTIONS] [--section.key VALUE ...]\n")
    console.print(description + "\n")
    opts = Table(title="options", title_justify="left", show_header=False, box=None)
    for flag, doc in options:
        opts.add_row(f"[cyan]{flag}[/cyan]", doc)
    console.print(opts)
    console.print("Flags override --config; values are YAML scalars; list flags repeat or take a,b,c.\n")
    sections: dict[str, Table] = {}
    for f in iter_fields(cls):
        ns = f.path.split(".")[0]
        if ns == "learner" and f.path.split(".")[1] in LEARNER_FIELDS_SET_ELSEWHERE:
            continue
        if ns not in sections:
            sections[ns] = Table(title=f"--{ns}.*", title_justify="left", expand=False)
            for col in ("flag", "type", "default", "description"):
                sections[ns].add_column(col, overflow="fold")
        default = "-" if f.default is None else str(f.default)
        sections[ns].add_row(f"--{f.path}", _type_name(f.annotation), default, f.doc)
    for table in sections.values():
        console.print(table)
    return console.export_text()
