"""LoRA: training lowers the loss, only adapters change, merged weights equal base + adapter."""

from __future__ import annotations

import pytest
import torch
from rlhf_algos import sft_loss
from rlhf_learner.lora import LoraOptions, apply_lora, load_qlora_base, merge_adapter, save_adapter
from rlhf_learner.models import Actor, load_causal_lm
from rlhf_learner.steps import SFTBatch, sft_step
from rlhf_learner.strategy import Strategy, StrategyOptions
from transformers import AutoModelForCausalLM


def test_lora_trains_saves_and_merges(dist_single, tiny_model_dir, tmp_path):
    peft_model = apply_lora(load_causal_lm(tiny_model_dir), LoraOptions(rank=4, alpha=8.0))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    strategy = Strategy(StrategyOptions(zero_stage=2, lr=1e-2))
    engine = strategy.prepare(Actor(peft_model))
    g = torch.Generator().manual_seed(0)
    mb = SFTBatch(
        input_ids=torch.randint(3, 400, (2, 12), generator=g),
        attention_mask=torch.ones(2, 12, dtype=torch.long),
        loss_mask=torch.ones(2, 12, dtype=torch.bool),
    )
    losses = [sft_step(engine, [mb], sft_loss_fn=sft_loss).loss for _ in range(6)]
    assert losses[-1] < losses[0] - 0.3

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    base_state = base.state_dict()
    for name, p in peft_model.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(p.detach(), base_state[name.replace(".base_layer.", ".")]), name

    adapter = save_adapter(peft_model, tmp_path / "adapter")
    assert (adapter / "adapter_config.json").is_file()
    merged_dir = merge_adapter(tiny_model_dir, adapter, tmp_path / "merged")
    exported_dir = strategy.export_hf(engine.module, tmp_path / "exported")
    ids = mb.input_ids
    with torch.no_grad():
        expect = peft_model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir)(ids).logits
        exported = AutoModelForCausalLM.from_pretrained(exported_dir)(ids).logits
        untouched = base(ids).logits
    torch.testing.assert_close(merged, expect, atol=1e-5, rtol=0)
    torch.testing.assert_close(exported, expect, atol=1e-5, rtol=0)
    assert (expect - untouched).abs().max() > 1e-3


def test_lora_options_and_merge_inputs_are_checked(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="lora rank"):
        LoraOptions(rank=0)
    with pytest.raises(ValueError, match="lora dropout"):
        LoraOptions(dropout=1.0)
    with pytest.raises(ValueError, match="adapter folder"):
        merge_adapter(tiny_model_dir, tmp_path / "missing", tmp_path / "out")


def _qlora_possible() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes") is not None


@pytest.mark.skipif(_qlora_possible(), reason="CUDA and bitsandbytes present: test_gpu.py covers QLoRA")
def test_qlora_without_cuda_or_bitsandbytes_raises_a_clear_error(tiny_model_dir):
    lora = LoraOptions(rank=4, load_in_4bit=True)
    with pytest.raises(ValueError, match=r"^load_in_4bit: ") as err:
        load_causal_lm(tiny_model_dir, lora=lora)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^load_in_4bit: "):
        load_qlora_base(tiny_model_dir)


def test_qlora_is_refused_with_zero3_and_on_a_full_precision_base(tiny_model_dir):
    lora = LoraOptions(rank=4, load_in_4bit=True)
    ds_config = Strategy(StrategyOptions(zero_stage=3)).ds_config()
    with pytest.raises(ValueError, match=r"^load_in_4bit with zero_stage=3: ZeRO-3 cannot shard 4-bit"):
        load_causal_lm(tiny_model_dir, ds_config=ds_config, lora=lora)
    with pytest.raises(ValueError, match=r"^load_in_4bit: the base model was not loaded in 4 bit"):
        apply_lora(load_causal_lm(tiny_model_dir), lora)


def test_load_causal_lm_with_lora_gives_the_peft_model(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, lora=LoraOptions(rank=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert hasattr(model, "peft_config") and trainable and all("lora_" in n for n in trainable)


def test_lora_is_refused_under_autotp(dist_single, tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, lora=LoraOptions(rank=4))
    with pytest.raises(ValueError, match=r"^tensor_parallel_size > 1 with a LoRA model"):
        Strategy(StrategyOptions(zero_stage=1, tensor_parallel_size=2)).prepare(Actor(model))
