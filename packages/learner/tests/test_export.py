"""Hugging Face export: sharded safetensors with an index, bf16, a re-export replaces the old layout."""

from __future__ import annotations

import json

import pytest
import torch
from rlhf_learner.strategy import Strategy, StrategyOptions
from safetensors import safe_open
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def source(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _ids() -> torch.Tensor:
    return torch.randint(3, 400, (2, 16), generator=torch.Generator().manual_seed(0))


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    return out


def test_small_max_shard_bytes_gives_shards_and_an_index_that_transformers_loads(source, tmp_path):
    folder = Strategy(StrategyOptions()).export_hf(source, tmp_path / "sharded", max_shard_bytes=300_000)
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (folder / "model.safetensors").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    written = _tensors(folder)
    assert set(index["weight_map"]) == set(written) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    for shard in shards:  # every shard within the limit (no single tensor here exceeds it)
        assert (folder / shard).stat().st_size < 300_000 + 10_000
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(_ids()).logits, source(_ids()).logits, atol=0, rtol=0)


def test_bf16_export_writes_bf16_tensors_records_the_dtype_and_loads(source, tiny_model_dir, tmp_path):
    folder = Strategy(StrategyOptions()).export_hf(
        source, tmp_path / "bf16", dtype=torch.bfloat16, max_shard_bytes=200_000
    )
    assert {t.dtype for t in _tensors(folder).values()} == {torch.bfloat16}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)  # the rounded weights
    for name, p in source.state_dict().items():
        torch.testing.assert_close(expected.state_dict()[name], p.to(torch.bfloat16).float(), atol=0, rtol=0)
    # the same as the source folder loaded in bf16 (a cast of the source module would also round the
    # rotary inv_freq buffer, which transformers keeps in fp32)
    direct = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(_ids()).logits, direct(_ids()).logits, atol=0, rtol=0)


def test_default_gives_one_file_and_a_re_export_replaces_the_shards(source, tmp_path):
    strategy = Strategy(StrategyOptions())
    folder = strategy.export_hf(source, tmp_path / "out", max_shard_bytes=300_000)
    assert (folder / "model.safetensors.index.json").is_file()
    strategy.export_hf(source, folder)
    assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]
    assert not (folder / "model.safetensors.index.json").exists()
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(folder)
        torch.testing.assert_close(loaded(_ids()).logits, source(_ids()).logits, atol=0, rtol=0)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_max_shard_bytes_names_the_option(source, tmp_path, bad):
    with pytest.raises(ValueError, match="max_shard_bytes"):
        Strategy(StrategyOptions()).export_hf(source, tmp_path / "x", max_shard_bytes=bad)
    assert not (tmp_path / "x").exists()
