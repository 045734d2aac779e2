"""LoRA: training lowers the loss, only adapters change, merged weights equal base + adapter."""

from __future__ import annotations

from pathlib import Path

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


# --- QLoRA merge: names, key filters, delta formula; the merge itself with a stand-in for bitsandbytes ---


def test_qlora_merge_maps_peft_names_to_the_base_models_and_drops_adapter_and_quant_state_keys():
    from rlhf_learner.qlora_merge import is_adapter_key, is_quant_state_key, plain_name, plain_state

    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    assert plain_name(f"{layer}.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert plain_name(f"{layer}.base_layer.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert plain_name(f"{layer}.base_layer") == "model.layers.0.self_attn.q_proj"  # a module name
    assert plain_name("base_model.model.lm_head.weight") == "lm_head.weight"
    assert plain_name("model.norm.weight") == "model.norm.weight"  # already plain
    assert all(is_adapter_key(f"{layer}.lora_{ab}.default.weight") for ab in "AB")
    assert not is_adapter_key(f"{layer}.base_layer.weight")
    quant_state = [
        f"{layer}.base_layer.weight.{k}"
        for k in ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4")
    ]
    assert all(is_quant_state_key(k) for k in quant_state)
    assert not any(map(is_quant_state_key, (f"{layer}.base_layer.weight", "model.absmax.weight")))
    t = torch.zeros(1)
    state = {
        f"{layer}.base_layer.weight": t,
        f"{layer}.base_layer.bias": t,
        f"{layer}.lora_A.default.weight": t,
        f"{layer}.lora_B.default.weight": t,
        "base_model.model.model.embed_tokens.weight": t,
        **dict.fromkeys(quant_state, t),
    }
    assert list(plain_state(state)) == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.embed_tokens.weight",
    ]
    with pytest.raises(ValueError, match=r"^load_in_4bit: two tensors .* 'model.norm.weight'$"):
        plain_state({"base_model.model.model.norm.weight": t, "model.norm.weight": t})


def test_lora_delta_is_peft_get_delta_weight(tiny_model_dir):
    from rlhf_learner.qlora_merge import lora_delta

    model = apply_lora(load_causal_lm(tiny_model_dir), LoraOptions(rank=4, alpha=12.0))
    layer = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=g))
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    got = lora_delta(b, a, layer.scaling["default"])
    torch.testing.assert_close(got, layer.get_delta_weight("default"), atol=1e-6, rtol=1e-6)
    assert layer.scaling["default"] == 3.0
    torch.testing.assert_close(lora_delta(b, a, 3.0, fan_in_fan_out=True), got.T)


class Params4bit(torch.nn.Parameter):
    """Named as bitsandbytes' 4-bit parameter class (the merge recognises 4-bit weights by that name);
    its ``quant_state`` is the bf16 weight the stand-in ``dequantize_4bit`` returns."""


def _fake_4bit(peft_model) -> None:
    """Replace every linear weight but the output head by packed bytes + a ``quant_state``, as
    ``bnb.nn.Linear4bit`` holds them (in place)."""
    for name, mod in list(peft_model.named_modules()):
        if type(mod) is not torch.nn.Linear or ".lora_" in name or name.endswith("lm_head"):
            continue
        w = mod.weight.detach()
        packed = Params4bit(torch.zeros(w.numel() // 2, 1, dtype=torch.uint8), requires_grad=False)
        packed.quant_state = w.to(torch.bfloat16)
        mod.weight, mod.compute_dtype = packed, torch.bfloat16
    peft_model.get_base_model().is_loaded_in_4bit = True


def _stand_in_bitsandbytes(monkeypatch) -> None:
    import sys
    import types

    bnb, functional = types.ModuleType("bitsandbytes"), types.ModuleType("bitsandbytes.functional")
    functional.dequantize_4bit = lambda data, quant_state: quant_state
    bnb.functional = functional
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", functional)


def test_4bit_merge_adds_the_delta_to_dequantized_weights_and_exports(tiny_model_dir, tmp_path, monkeypatch):
    """Without a GPU: a stand-in ``dequantize_4bit``, 4-bit layers with and without adapters, against
    peft's own merge of the same (bf16-rounded) weights."""
    import copy
    import json

    from rlhf_learner.lora import merged_state_dict

    base = load_causal_lm(tiny_model_dir)
    with torch.no_grad():  # bf16 base weights, as a QLoRA base is loaded
        for p in base.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model = apply_lora(base, LoraOptions(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"]))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    _fake_4bit(model)
    model.get_base_model().config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    strategy = Strategy(StrategyOptions(zero_stage=2))
    state = strategy.full_state_dict(model)
    with monkeypatch.context() as m:
        _stand_in_bitsandbytes(m)
        merged, _ = merged_state_dict(model, state)
        folder = strategy.export_hf(model, tmp_path / "exported")
    assert set(merged) == set(reference) - {"lm_head.weight"}  # tied to the embedding
    assert all(t.dtype == torch.bfloat16 for t in merged.values())
    for key, t in merged.items():
        torch.testing.assert_close(t.float(), reference[key].float(), atol=2e-3, rtol=1e-2, msg=key)
    layers = "base_model.model.model.layers.0"
    q_base = model.get_submodule(f"{layers}.self_attn.q_proj.base_layer").weight.quant_state
    k_base = model.get_submodule(f"{layers}.self_attn.k_proj").weight.quant_state  # no adapter
    assert (merged["model.layers.0.self_attn.q_proj.weight"].float() - q_base.float()).abs().max() > 1e-2
    assert torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], k_base)
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain.load_state_dict({k: v.float() for k, v in reference.items()})
    ids = torch.randint(3, 400, (2, 10), generator=g)
    with torch.no_grad():
        expect = plain(ids).logits
        got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(got, expect, atol=3e-2 * expect.abs().max().item(), rtol=0)


def test_an_adapter_is_merged_only_into_the_weights_it_was_trained_on(tiny_model_dir, tmp_path):
    """The adapter's folder records its base's weights fingerprint: a copy of the base elsewhere merges, a
    checkpoint of the same architecture with other weights is refused in one line (``force`` merges)."""
    import shutil

    from rlhf_learner.lora import BASE_FINGERPRINT, check_adapter_matches

    adapter = save_adapter(
        apply_lora(load_causal_lm(tiny_model_dir), LoraOptions(rank=4)), tmp_path / "adapter"
    )
    assert (adapter / BASE_FINGERPRINT).is_file()
    moved = Path(shutil.copytree(tiny_model_dir, tmp_path / "moved"))
    check_adapter_matches(moved, adapter)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        next(p for p in other.parameters() if p.dim() == 2).mul_(1.01)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(
        ValueError, match=r"^adapter '.*adapter' was trained on '.*', whose weights are not"
    ) as err:
        merge_adapter(tmp_path / "other", adapter, tmp_path / "out")
    assert "--force" in str(err.value) and not (tmp_path / "out").exists()
    assert merge_adapter(tmp_path / "other", adapter, tmp_path / "out", force=True).is_dir()
    # an adapter saved by peft alone: its recorded base folder is compared instead
    (adapter / BASE_FINGERPRINT).unlink()
    with pytest.raises(ValueError, match="whose weights are not"):
        check_adapter_matches(tmp_path / "other", adapter)
    check_adapter_matches(moved, adapter)
