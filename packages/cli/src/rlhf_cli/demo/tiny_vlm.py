"""Build a tiny vision-language model (Qwen2-VL, Qwen2.5-VL or Qwen3-VL) with its tokenizer and processor
offline, saved as a Hugging Face folder that transformers (``AutoProcessor``,
``AutoModelForImageTextToText``) and vLLM (CPU or GPU) load. Nothing is downloaded: the weights are random (seeded), the tokenizer is the tiny
text model's byte-level BPE with the Qwen-VL vision tokens added, and the image processor keeps images
small (4 to 16 image tokens each)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_cli.demo.tiny_model import TinyModelSpec, build_tokenizer

__all__ = ["TINY_VLM_TYPES", "VISION_TOKENS", "VLM_CHAT_TEMPLATE", "build_tiny_vlm", "tiny_vlm_num_params"]

TINY_VLM_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""The ``model_type`` s :func:`build_tiny_vlm` builds."""

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""Qwen2-VL's vision tokens, as its config names them: start, end, image and video placeholders."""

VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML whose message content is a string, or a list of ``{"type": "image"}`` and
``{"type": "text", "text": ...}`` parts (an image becomes one placeholder the processor expands)."""


def _config(tokenizer, *, vocab_size: int, model_type: str = "qwen2_vl"):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    ids = dict(
        zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)),
            strict=True,
        )
    )
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    lm = TinyModelSpec()  # the language model: the tiny text model's shape
    shape = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    text = {k: getattr(lm, k) for k in (*shape, "max_position_embeddings", "tie_word_embeddings")}
    # M-RoPE: the head's 32 rotary frequencies split over time, height and width
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
    text |= dict(vocab_size=vocab_size, **special)
    if model_type == "qwen3_vl":  # 16-pixel patches, a deepstack merger, M-RoPE interleaved over the head
        text["head_dim"] = lm.hidden_size // lm.num_attention_heads
        text["rope_parameters"] |= {"mrope_interleaved": True}
        del text["tie_word_embeddings"]  # said on the whole model only (vLLM ties from there)
        vision = dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=lm.hidden_size,
            patch_size=16, spatial_merge_size=2, deepstack_visual_indexes=[0], num_position_embeddings=64,
        )  # fmt: skip
        return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    if model_type == "qwen2_5_vl":  # windowed attention (56-pixel windows) in block 0, full in block 1
        vision = dict(
            depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=lm.hidden_size,
            patch_size=14, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1],
        )  # fmt: skip
        return Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, tie_word_embeddings=True, **ids, **special
        )
    vision = dict(
        depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2
    )
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids, **special)


def _tokenizer(seed: int, vocab_size: int):
    tokenizer = build_tokenizer(vocab_size=vocab_size - 16, seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|eos|>", "<|im_start|>", *VISION_TOKENS]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def tiny_vlm_num_params(*, vocab_size: int = 512) -> int:
    """Parameters of :func:`build_tiny_vlm`'s model, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(_config(_tokenizer(0, vocab_size), vocab_size=vocab_size))
    return sum(p.numel() for p in model.parameters())


def build_tiny_vlm(
    path: str | Path, *, seed: int = 0, vocab_size: int = 512, model_type: str = "qwen2_vl"
) -> Path:
    """Write a tiny random vision-language model (``model_type`` ``qwen2_vl``, about 0.6M parameters,
    ``qwen2_5_vl`` or ``qwen3_vl``), its tokenizer and processor to ``path`` and return it. The same
    ``seed`` always gives the same folder."""
    import torch
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    if model_type not in TINY_VLM_TYPES:
        raise ValueError(f"model_type {model_type!r}: expected one of {', '.join(TINY_VLM_TYPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(seed, vocab_size)
    torch.manual_seed(seed)
    config = _config(tokenizer, vocab_size=vocab_size, model_type=model_type)
    kind = {
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration,
    }[model_type]
    model = kind(config).to(torch.float32)
    with torch.no_grad():  # larger than the default init, so that sampled text and log-probs vary
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    if model_type == "qwen3_vl":  # 16-pixel patches: 64x64 to 128x128 pixels, 4 to 16 image tokens
        images = Qwen2VLImageProcessor(min_pixels=64 * 64, max_pixels=128 * 128, patch_size=16)
        processor: Any = Qwen3VLProcessor(
            image_processor=images, video_processor=Qwen3VLVideoProcessor(), tokenizer=tokenizer
        )
    else:
        images = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
        family = Qwen2_5_VLProcessor if model_type == "qwen2_5_vl" else Qwen2VLProcessor
        processor = family(
            image_processor=images, video_processor=Qwen2VLVideoProcessor(), tokenizer=tokenizer
        )
    processor.chat_template = VLM_CHAT_TEMPLATE
    from rlhf_learner.strategy.export import quiet_progress_bars

    with quiet_progress_bars():
        model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return path
