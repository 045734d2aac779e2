"""Build a configuration tree from a YAML file and dotted flags; errors name the flag or key."""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import itertools
import types
import typing
from collections.abc import Collection, Iterator, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from rlhf_cli.config.hints import suggest as _suggest
from rlhf_cli.config.hints import unknown_flag as _unknown_flag
from rlhf_cli.config.renamed import current_name

__all__ = [
    "ConfigError",
    "FieldInfo",
    "build_config",
    "current_tree",
    "flat_items",
    "iter_fields",
    "parse_flags",
]

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration problem, in one line that names the flag, file or key."""


class FieldInfo(typing.NamedTuple):
    path: str
    """Dotted path, e.g. ``algo.kl.coef``."""
    annotation: Any
    default: Any
    doc: str


def _branch_type(annotation: Any) -> type | None:
    """The section (pydantic model or dataclass) inside ``X`` / ``X | None``, if any."""
    args = (
        typing.get_args(annotation)
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
        else (annotation,)
    )
    for a in args:
        if isinstance(a, type) and (issubclass(a, BaseModel) or is_dataclass(a)):
            return a
    return None


@functools.cache
def _attribute_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a class and its bases (the string literal after each field); read once
    per class (every flag parse and ``--help`` needs them)."""
    import inspect

    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        with contextlib.suppress(OSError, TypeError):
            out |= _module_docs(inspect.getsourcefile(klass) or "").get(klass.__qualname__, {})
    return out


@functools.cache
def _module_docs(filename: str) -> dict[str, dict[str, str]]:
    """``{class qualname: {attribute: docstring}}`` for the classes of one source file, parsed once
    (``inspect.getsource`` re-parses the whole module for each class: over a second per command)."""
    import ast

    out: dict[str, dict[str, str]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                docs = out.setdefault(prefix + node.name, {})
                for stmt, nxt in itertools.pairwise(node.body):
                    if (
                        isinstance(stmt, ast.AnnAssign)
                        and isinstance(stmt.target, ast.Name)
                        and isinstance(nxt, ast.Expr)
                        and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)
                    ):
                        docs[stmt.target.id] = " ".join(nxt.value.value.split())
                visit(node.body, f"{prefix}{node.name}.")

    with contextlib.suppress(OSError, SyntaxError, ValueError):
        visit(ast.parse(Path(filename).read_bytes()).body, "")
    return out


def _children(cls: type) -> Iterator[tuple[str, str, Any, Any]]:
    """``(name, attribute, annotation, default)`` of a section's fields; ``name`` is what flags and files
    call it (a field's alias: ``async`` for the attribute ``async_``)."""
    if issubclass(cls, BaseModel):
        for attr, f in cls.model_fields.items():
            default = f.default_factory() if f.default_factory is not None else f.default
            yield f.alias or attr, attr, f.annotation, default
    else:
        hints = typing.get_type_hints(cls)
        instance_defaults = {}
        with contextlib.suppress(TypeError):
            instance_defaults = {f.name: getattr(cls(), f.name) for f in fields(cls)}
        for f in fields(cls):
            yield f.name, f.name, hints[f.name], instance_defaults.get(f.name)


def iter_fields(cls: type, prefix: str = "", default: Any = None) -> Iterator[FieldInfo]:
    """Every leaf of the tree under ``cls`` with its dotted path, type, default and docstring."""
    docs = _attribute_docs(cls)
    for name, attr, annotation, dflt in _children(cls):
        if default is not None:
            dflt = getattr(default, attr, dflt)
        path = f"{prefix}{name}"
        branch = _branch_type(annotation)
        if branch is not None:
            yield from iter_fields(branch, path + ".", dflt)
        else:
            yield FieldInfo(path, annotation, dflt, docs.get(attr, ""))


def _is_list(annotation: Any) -> bool:
    args = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    seqs = (list, tuple, typing.Sequence, collections.abc.Sequence)
    return any(typing.get_origin(a) in seqs for a in args if a is not None)


def _is_text(annotation: Any) -> bool:
    """A ``str`` or ``str | None`` field."""
    args = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    return {a for a in args if a is not type(None)} == {str}


def _is_bool(annotation: Any) -> bool:
    args = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    return bool in args


def _set(tree: dict, path: str, value: Any, *, append: bool) -> None:
    node = tree
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{path}: {p} is a value, not a section")
    if append and isinstance(node.get(leaf), list):
        node[leaf] = node[leaf] + list(value)
    else:
        node[leaf] = value


def flat_items(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted.path, leaf)`` of a nested mapping (an empty mapping is a leaf)."""
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from flat_items(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def parse_flags(cls: type[BaseModel], argv: Sequence[str]) -> dict:
    """``--a.b value`` / ``--a.b=value`` / a bare ``--flag`` for booleans, into a nested dict.

    Values are read as YAML scalars (``1e-3``, ``true``, ``null``); list fields take repeated flags
    or comma-separated values. Unknown flags raise naming the closest valid one (an OpenRLHF flag: its
    name here)."""
    leaves = {f.path: f for f in iter_fields(cls)}
    sections = {p.rsplit(".", i)[0] for p in leaves for i in range(1, p.count(".") + 1)}
    tree: dict = {}
    spelled: dict[str, str] = {}  # current name -> as given (an old name and its new one clash)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --section.key value")
        name, eq, raw = arg[2:].partition("=")
        given = name.replace("-", "_")
        command = getattr(cls, "command", None)
        name = current_name(given, leaves.keys() | sections, command)
        if spelled.setdefault(name, given) != given:
            raise ConfigError(f"--{spelled[name]} and --{given} set the same value (--{name}); give one")
        info = leaves.get(name)
        if info is None:
            # a section given a whole YAML mapping (e.g. --actor.lora '{rank: 8}') or a None-able section
            if name in sections:
                if not eq:
                    i += 1
                    if i >= len(argv):
                        raise ConfigError(f"--{name}: expects a YAML mapping")
                    raw = argv[i]
                tree = _section_flag(tree, name, raw, leaves.keys() | sections, command)
                i += 1
                continue
            raise ConfigError(_unknown_flag(name, leaves))
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if _is_bool(info.annotation) and (nxt is None or nxt.startswith("--")):
                raw = "true"
            elif nxt is None:
                raise ConfigError(f"--{name}: expects a value")
            else:
                raw = nxt
                i += 1
        value: Any = _scalar(raw, name)
        if _is_text(info.annotation) and not isinstance(value, str | None):
            value = raw  # a text flag: "Q: {}" stays text (YAML would read a mapping)
        if _is_list(info.annotation):
            value = value if isinstance(value, list) else [s for s in str(raw).split(",") if s]
            _set(tree, name, value, append=True)
        else:
            _set(tree, name, value, append=False)
        i += 1
    return tree


def _section_flag(tree: dict, name: str, raw: str, known: Collection[str], command: str | None) -> dict:
    """``tree`` with section ``--name`` given a whole YAML mapping (its keys under their current names too:
    ``--vllm '{num_engines: 2}'``), or None."""
    value = _scalar(raw, name)
    if not isinstance(value, dict) and value is not None:
        raise ConfigError(f"--{name}: is a section; expected a YAML mapping, got {raw!r}")
    if value is None:
        _set(tree, name, None, append=False)
        return tree
    return _merge(tree, current_tree({name: value}, known, command=command))


def _scalar(raw: str, name: str) -> Any:
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw
    if isinstance(value, str) and _looks_numeric(value):
        return raw
    return value


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _load_yaml(path: Path, cls: type[BaseModel]) -> dict:
    if path.is_dir():
        raise ConfigError(f"--config: {str(path)!r} is a folder, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"--config: file {str(path)!r} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(f"{path}, line {line}: not UTF-8 text (byte {raw[err.start]:#04x})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    valid = [f.path for f in iter_fields(cls)]
    sections = {p.rsplit(".", i)[0] for p in valid for i in range(1, p.count(".") + 1)}
    data = current_tree(data, set(valid) | sections, where=str(path), command=getattr(cls, "command", None))
    for key, _ in flat_items(data):
        if key not in valid and key not in sections:
            raise ConfigError(f"{path}: unknown key {key}{_suggest(key, valid, dash='')}")
    return data


def current_tree(
    tree: dict, known: Collection[str] = (), *, where: str = "", command: str | None = None
) -> dict:
    """``tree`` with each setting under its current name (``renamed.RENAMED``): a YAML file or a
    checkpoint's ``config.json`` written before a setting moved reads as if written after. A setting
    given under both names is refused, naming both."""
    out: dict = {}
    spelled: dict[str, str] = {}
    for key, value in flat_items(tree):
        name = current_name(key, known, command)
        if spelled.setdefault(name, key) != key:
            raise ConfigError(f"{where}: {spelled[name]} and {key} set the same value ({name}); keep one")
        if value == {} and _has(out, name):  # an empty section adds nothing to one already read
            continue
        _set(out, name, value, append=False)
    return out


def _has(tree: dict, path: str) -> bool:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def build_config(cls: type[T], argv: Sequence[str] = (), *, config_file: Path | None = None) -> T:
    """The validated tree: defaults <- ``config_file`` (YAML) <- dotted flags in ``argv``."""
    data = _load_yaml(config_file, cls) if config_file is not None else {}
    flags = parse_flags(cls, argv)
    merged = _merge(data, flags)
    flag_paths = {p for p, _ in flat_items(flags)}
    try:
        return cls.model_validate(merged)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(x) for x in e["loc"] if not str(x).startswith(("function-", "lax-", "json-")))
        loc = _drop_type_tags(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not loc:
            raise ConfigError(msg) from None
        head, sep, tail = msg.partition(": ")
        if sep and f"{loc}.{head}" in {
            f.path for f in iter_fields(cls)
        }:  # a section's own check names its field
            loc, msg = f"{loc}.{head}", tail
        origin = "--" + loc if loc in flag_paths or not data else f"{loc} (in {config_file})"
        got = e.get("input")
        got_s = f" (got {got!r})" if not isinstance(got, dict) and e["type"] != "value_error" else ""
        raise ConfigError(f"{origin}: {msg}{got_s}") from None


def _drop_type_tags(loc: tuple) -> str:
    """Pydantic locations include union-member tags (``StrategyOptions``, ``function-after[...]``)."""
    parts = [str(x) for x in loc]
    keep = [p for p in parts if p.isidentifier() and not p[:1].isupper()]
    return ".".join(keep)
