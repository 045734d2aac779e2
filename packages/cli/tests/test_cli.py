from rlhf_cli.main import app
from typer.testing import CliRunner


def test_estimators_lists_every_registered_name():
    result = CliRunner().invoke(app, ["estimators"])
    assert result.exit_code == 0, result.output
    names = [line.split()[0] for line in result.output.strip().splitlines()]
    assert names == ["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo"]


def test_tiny_model_writes_a_loadable_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = CliRunner().invoke(app, ["tiny-model", str(tmp_path / "m"), "--architecture", "llama"])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert model.config.model_type == "llama"
    assert len(tok) <= model.config.vocab_size
