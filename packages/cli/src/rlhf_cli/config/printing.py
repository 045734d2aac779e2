"""``--print-config``: the resolved tree as YAML that ``--config`` reads back."""

from __future__ import annotations

import yaml
from pydantic import BaseModel

__all__ = ["dump_yaml"]


def dump_yaml(config: BaseModel) -> str:
    """The resolved tree as YAML that ``--config`` accepts again. An unset setting whose value the run
    derives (``derived_values()``, e.g. an offline command's learning rate from its model) stays null, so
    the file derives it again, with the value it takes now in a comment."""
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
    derived = getattr(config, "derived_values", dict)()
    if not derived:
        return text
    lines, path = [], []  # path: (indent, key) of the sections above the line
    for line in text.splitlines():
        key, _, rest = line.strip().partition(":")
        indent = len(line) - len(line.lstrip())
        path = [(i, k) for i, k in path if i < indent]
        dotted = ".".join([k for _, k in path] + [key])
        if rest.strip() == "null" and dotted in derived:
            line += f"  # unset: {derived[dotted]} is used"
        path.append((indent, key))
        lines.append(line)
    return "\n".join(lines) + "\n"
