"""The documentation: the site builds in strict mode (a broken link, a missing page or a bad API
reference fails), its generated pages come from the configuration tree, and every `rlhf` command in
the README's and the docs' code blocks parses with the current CLI. (docs/tutorial.md runs as written:
packages/cli/tests/test_tutorial.py.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted(ROOT.glob("packages/*/README.md")),
]
_BLOCK = re.compile(r"```(?:bash|shell|sh|console)\n(.*?)```", re.S)
_NOT_FLAGS = {"--dry-run", "--print-config", "--help"}


def commands_in(page: Path) -> list[tuple[str, list[str]]]:
    """``(command, flags)`` of each ``rlhf <command> ...`` line in the page's shell code blocks
    (backslash continuations joined; ``uv run`` and ``&&`` chains taken apart)."""
    found = []
    for block in _BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\||;", line):
                words = shlex.split(part.split(" #")[0].strip().rstrip("&").strip() or "true")
                while words and words[0] in ("uv", "run", "--no-sync", "python", "-m"):
                    words = words[1:]
                if len(words) >= 2 and words[0] == "rlhf":
                    found.append((words[1], words[2:]))
    return found


def _parsable(flags: list[str]) -> list[str]:
    """The dotted flags alone (``--config FILE`` and the command options left out)."""
    out, skip = [], False
    for word in flags:
        if skip:
            skip = False
        elif word == "--config":
            skip = True
        elif word not in _NOT_FLAGS:
            out.append(word)
    return out


def test_every_rlhf_command_in_the_docs_parses():
    from rlhf_cli.config import build_config
    from rlhf_cli.config.reference import COMMAND_CONFIGS

    checked = 0
    for page in PAGES:
        for command, flags in commands_in(page):
            if command not in COMMAND_CONFIGS or "--help" in flags:
                continue
            try:
                build_config(COMMAND_CONFIGS[command], _parsable(flags))
            except ValueError as err:
                pytest.fail(f"{page.relative_to(ROOT)}: rlhf {command} {' '.join(flags)}: {err}")
            checked += 1
    assert checked >= 10, "the docs lost their examples"


def test_the_site_builds_in_strict_mode_with_its_generated_pages(tmp_path):
    site = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "DISABLE_MKDOCS_2_WARNING": "true", "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    ppo = (site / "reference" / "ppo" / "index.html").read_text()
    assert "--rollout.num_engines" in ppo and "--learner.backend" in ppo  # from the configuration tree
    assert "--actor_learning_rate" in (site / "reference" / "openrlhf" / "index.html").read_text()
    assert "compute_advantages" in (site / "api" / "algos" / "index.html").read_text()  # from docstrings
    assert "RetryQuizEnv" in (site / "agents" / "index.html").read_text()  # examples/ included, not copied


def test_the_readmes_python_example_runs(tmp_path):
    (code,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]


_TIMING = re.compile(
    r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:s|ms|seconds?|min)\b(?! *\()|\b\d+(?:\.\d+)?x (?:faster|slower)"
)


def test_help_carries_no_measurements():
    """Each flag's help says what it does; figures live on the performance page."""
    from rlhf_cli.config.help import render_help
    from rlhf_cli.config.reference import COMMAND_CONFIGS

    for command, cls in COMMAND_CONFIGS.items():
        text = render_help(cls, command=f"rlhf {command}", description=cls.__doc__ or "", options=[])
        found = [line.strip() for line in text.splitlines() if _TIMING.search(line)]
        assert not found, f"rlhf {command} --help: {found[:5]}"
