from rlhf_algos import ADVANTAGE_ESTIMATORS
from rlhf_cli.main import app
from typer.testing import CliRunner


def test_estimators_lists_every_registered_name():
    result = CliRunner().invoke(app, ["estimators"])
    assert result.exit_code == 0, result.output
    names = [line.split()[0] for line in result.output.strip().splitlines()]
    assert names == list(ADVANTAGE_ESTIMATORS)  # a plugin loaded earlier in this process adds its own
    assert names[:6] == ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"]


def test_tiny_model_writes_a_loadable_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = CliRunner().invoke(app, ["tiny-model", str(tmp_path / "m"), "--architecture", "llama"])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert model.config.model_type == "llama"
    assert len(tok) <= model.config.vocab_size


def test_the_command_turns_off_rays_uv_run_hook_before_ray_is_imported():
    """Under ``uv run``, Ray's hook (on unless RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 when Ray is first imported)
    would rebuild the environment per worker without the extras, so engines would find no vLLM."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_UV_RUN_RUNTIME_ENV"}
    check = "import rlhf_cli.main, ray._private.ray_constants as c; print(c.RAY_ENABLE_UV_RUN_RUNTIME_ENV)"
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    bare = subprocess.run(
        [sys.executable, "-c", "import ray._private.ray_constants as c; print(c.RAY_ENABLE_UV_RUN_RUNTIME_ENV)"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bare.stdout.strip() == "True"  # Ray's default, which the check above would not catch otherwise
