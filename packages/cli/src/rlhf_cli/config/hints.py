"""What an unknown flag or key was probably meant to be: the closest valid name, or an OpenRLHF flag's
name here."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Sequence

from rlhf_cli.config.openrlhf_names import openrlhf_hint

__all__ = ["suggest", "unknown_flag"]


def _words(path: str) -> set[str]:
    return set(path.replace(".", "_").split("_"))


def _near(a: str, b: str) -> bool:
    """Nearly the same letters once the separators are gone (``datapath``, ``data.path``)."""
    squash = str.maketrans("", "", "._")
    return difflib.SequenceMatcher(None, a.translate(squash), b.translate(squash)).ratio() >= 0.85


_SYNONYMS = {"learning_rate": "lr", "learning_rate_scheduler": "lr_scheduler", "lr_schedule": "lr_scheduler"}
"""A key's other names, tried before the closest spelling (``--actor.learning_rate`` is ``--actor.lr``,
not ``--actor.lr_warmup_ratio``)."""


def suggest(path: str, valid: Sequence[str], *, dash: str) -> str:
    """The closest valid key (difflib) that shares a word with ``path`` or nearly all its letters
    (``--log.eval_steps`` is not ``--algo.clip.value_eps``), else one with ``path``'s last segment."""
    head, _, leaf = path.rpartition(".")
    synonym = f"{head}.{_SYNONYMS[leaf]}" if head and leaf in _SYNONYMS else None
    if synonym in valid:
        return f"; did you mean {dash}{synonym}?"
    close = difflib.get_close_matches(path, valid, n=5, cutoff=0.6)
    close = [c for c in close if _words(path) & _words(c) or _near(path, c)][:1]
    if not close:
        # try the last segment alone (e.g. --lr for --actor.lr)
        leaf = path.rsplit(".", 1)[-1]
        close = [v for v in valid if v.rsplit(".", 1)[-1] == leaf][:1]
    return f"; did you mean {dash}{close[0]}?" if close else ""


def unknown_flag(name: str, leaves: Collection[str]) -> str:
    """The error message for ``--name``: an OpenRLHF flag's name here, else the closest flag ``--help`` shows (not
    the ``--learner`` fields another flag sets)."""
    from rlhf_cli.config.run import LEARNER_FIELDS_SET_ELSEWHERE

    shown = [
        p
        for p in leaves
        if not (p.startswith("learner.") and p.split(".")[1] in LEARNER_FIELDS_SET_ELSEWHERE)
    ]
    hint = openrlhf_hint(name, shown) or suggest(name, shown, dash="--")
    return f"unknown flag --{name}{hint}"
