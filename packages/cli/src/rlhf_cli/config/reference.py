"""The documentation's generated pages: each command's flag reference and the OpenRLHF flag table, from
the same configuration tree and name table that drive ``--help`` and the error hints."""

from __future__ import annotations

from rlhf_cli.config.help import set_elsewhere, type_name
from rlhf_cli.config.loading import iter_fields
from rlhf_cli.config.openrlhf_names import OPENRLHF_FLAGS, OPENRLHF_NOTES
from rlhf_cli.config.renamed import names_for

__all__ = ["COMMAND_CONFIGS", "flag_reference", "openrlhf_table"]


def _configs() -> dict[str, type]:
    from rlhf_cli.config import (
        DistillConfig,
        DPOConfig,
        KTOConfig,
        LoraMergeConfig,
        PPOConfig,
        RMConfig,
        ServeRMConfig,
        SFTConfig,
    )

    classes = (
        PPOConfig,
        SFTConfig,
        RMConfig,
        DPOConfig,
        KTOConfig,
        DistillConfig,
        ServeRMConfig,
        LoraMergeConfig,
    )
    return {cls.command: cls for cls in classes}


COMMAND_CONFIGS = _configs()
"""Command name -> its configuration tree."""


def _cell(text: str) -> str:
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


def flag_reference(command: str) -> str:
    """Markdown: every flag of ``rlhf <command>``, a table per section (flag, type, default, help)."""
    cls = COMMAND_CONFIGS[command]
    lines = [f"# rlhf {command}: every flag", "", _cell((cls.__doc__ or "").strip()), ""]
    lines += [
        "Generated from the configuration tree that `--help` shows. Flags override `--config FILE` (a YAML "
        "file of the same tree); values are YAML scalars; list flags repeat or take `a,b,c`.",
        "",
    ]
    section = None
    for f in iter_fields(cls):
        if set_elsewhere(f.path):
            continue
        top = f.path.split(".")[0] if "." in f.path else "(top level)"
        if top != section:
            section = top
            lines += ["", f"## `--{top}.*`" if "." in f.path else "## Top level", ""]
            lines += ["| flag | type | default | description |", "|---|---|---|---|"]
        default = "-" if f.default is None else f"`{f.default}`"
        lines.append(
            f"| `--{f.path}` | {_cell(type_name(f.annotation))} | {_cell(default)} | {_cell(f.doc)} |"
        )
    paths = [f.path for f in iter_fields(cls)]
    renamed = names_for(command).items()
    old = sorted((o, n) for o, n in renamed if any(p == n or p.startswith(n + ".") for p in paths))
    if old:
        also = "Also read, in flags, YAML files and checkpoints (old names of moved settings, and aliases):"
        lines += ["", "## Other names", "", also, ""]
        lines += ["| other name | current name |", "|---|---|"] + [f"| `--{o}` | `--{n}` |" for o, n in old]
    return "\n".join(lines) + "\n"


def openrlhf_table() -> str:
    """Markdown: each OpenRLHF flag and its counterpart in each command that has one."""
    valid = {name: {f.path for f in iter_fields(cls)} for name, cls in COMMAND_CONFIGS.items()}
    lines = ["| OpenRLHF | rlhf | note |", "|---|---|---|"]
    for flag, candidates in sorted(OPENRLHF_FLAGS.items()):
        ours = [f"`--{c}` ({', '.join(n for n, paths in valid.items() if c in paths)})" for c in candidates]
        ours = [o for o in ours if not o.endswith("()")]
        lines.append(f"| `--{flag}` | {'<br>'.join(ours) or '-'} | {_cell(OPENRLHF_NOTES.get(flag, ''))} |")
    return "\n".join(lines) + "\n"
