"""A tiny Qwen2-VL for the benchmarks: the demo's, its language model widened to a given text shape."""

from __future__ import annotations

from pathlib import Path


def build_wide_vlm(path: Path, *, max_side: int = 112, **text: int) -> Path:
    """The demo's tiny Qwen2-VL with its language model reshaped by ``text`` (``hidden_size``,
    ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``;
    random, seeded) and a processor that takes images up to ``max_side`` pixels square."""
    import torch
    from rlhf_cli.demo.tiny_vlm import build_tiny_vlm
    from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration

    build_tiny_vlm(path)
    cfg = AutoConfig.from_pretrained(path)
    for k, v in (text | dict(layer_types=["full_attention"] * text["num_hidden_layers"])).items():
        setattr(cfg.text_config, k, v)
    cfg.vision_config.hidden_size = text["hidden_size"]  # the projector's output: the language model's width
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(cfg).save_pretrained(path)
    processor = AutoProcessor.from_pretrained(path)
    processor.image_processor.max_pixels = max_side * max_side
    processor.image_processor.size = {"shortest_edge": 56 * 56, "longest_edge": max_side * max_side}
    processor.save_pretrained(path)
    return path
