"""Loading transformers models for training: checks, attention backend, ZeRO-3 construction."""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from rlhf_learner.models.vision import check_vision_language, is_vision_language

__all__ = [
    "ModelOptions",
    "attn_implementation",
    "check_compile",
    "check_model_dir",
    "check_sequence_length",
    "compile_model",
    "input_positions",
    "max_positions",
    "zero3_construction",
    "zero_stage",
]

AttnImplementation = Literal["sdpa", "eager", "flash_attention_2"]


@dataclass(kw_only=True)
class ModelOptions:
    """How a transformers model is built for the learner."""

    attn_implementation: AttnImplementation = "sdpa"
    """Attention kernel: ``sdpa`` / ``eager`` (CPU or GPU) or ``flash_attention_2`` (GPU + flash-attn)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    liger: bool = False
    """Patch the model with liger-kernel's fused Triton kernels (GPU + liger-kernel)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Weight dtype at load time."""
    compile: bool = False
    """``torch.compile`` the model (inductor, dynamic shapes): fused kernels in forward and backward, after
    a one-off compile in the first step (cached on disk under ``TORCHINDUCTOR_CACHE_DIR``). Not with
    ZeRO-3. On CPU pair it with ``attn_implementation='eager'``, which inductor fuses (sdpa's CPU kernels
    stay opaque to it, and their backward is slow in bf16)."""
    freeze_vision_tower: bool = True
    """Vision-language models: train the language model and the projector only (the vision tower frozen)."""

    def __post_init__(self) -> None:
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
            raise ValueError(
                f"attn_implementation: expected sdpa, eager or flash_attention_2, got {self.attn_implementation!r}"
            )
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype: expected fp32 or bf16, got {self.dtype!r}")
        if self.attn_implementation == "flash_attention_2":
            if not torch.cuda.is_available():
                raise ValueError("attn_implementation='flash_attention_2' needs a CUDA device")
            if importlib.util.find_spec("flash_attn") is None:
                raise ValueError("attn_implementation='flash_attention_2' needs the flash-attn package")
        if self.liger:
            if not torch.cuda.is_available():
                raise ValueError("liger: liger-kernel needs a CUDA device")
            if importlib.util.find_spec("liger_kernel") is None:
                raise ValueError("liger: the liger-kernel package is not installed")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bf16" else torch.float32


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Any one of these in a model folder counts as a tokenizer (transformers builds an empty one without)."""


def check_model_dir(
    path: str | Path, *, need_causal_lm: bool = True, need_tokenizer: bool = True
) -> dict[str, Any]:
    """Read and check ``path/config.json``; return it.

    Raises ``ValueError`` naming the folder when it, its config (or a readable one) or its weights are
    missing, (with ``need_causal_lm``) when the config names no ``*ForCausalLM`` architecture, and (with
    ``need_tokenizer``) when it holds no tokenizer file (transformers would silently build an empty
    tokenizer). Pass ``need_tokenizer=False`` for folders only the weights are read from.
    """
    p = Path(path)
    if p.is_file():
        raise ValueError(f"model folder {str(p)!r} is a file, not a folder")
    if not p.is_dir():
        raise ValueError(f"model folder {str(p)!r} does not exist")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model folder {str(p)!r} has no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{cfg_file}: not a JSON config ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(config).__name__}")
    archs = config.get("architectures") or []
    if need_causal_lm and is_vision_language(config):
        check_vision_language(config, where=f"model folder {str(p)!r}")
    elif need_causal_lm and not any(a.endswith("ForCausalLM") for a in archs):
        raise ValueError(
            f"model folder {str(p)!r} is not a causal LM: architectures={archs!r} has no *ForCausalLM"
        )
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ValueError(f"model folder {str(p)!r} has no weights (*.safetensors / *.bin)")
    if need_tokenizer and not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"model folder {str(p)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "save one there with tokenizer.save_pretrained"
        )
    return config


_POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_PRESCALED_ROPE = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})
"""RoPE types whose configs give ``max_position_embeddings`` already scaled (their ``factor`` is not applied)."""


def max_positions(config: Any) -> int | None:
    """The longest sequence (tokens) a model's (text) config allows, as vLLM derives it: ``model_max_length`` where
    set, else the smallest of the position keys present (``max_position_embeddings``, ``n_positions``, ...),
    times the RoPE scaling ``factor`` of a type that does not pre-scale its positions (linear, dynamic; not
    yarn, llama3, longrope; nor Gemma 3's); None when the config names no such key."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    explicit = getattr(text, "model_max_length", None)
    found = [v for k in _POSITION_KEYS if isinstance(v := getattr(text, k, None), int)]
    if not (explicit or found):
        return None
    limit = explicit or min(found)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    per_layer = [p for p in rope.values() if isinstance(p, dict)] if isinstance(rope, dict) else []
    params = per_layer or ([rope] if isinstance(rope, dict) else [])
    factors = [
        float(p.get("factor") or 1.0)
        for p in params
        if p.get("rope_type", p.get("type")) not in _PRESCALED_ROPE
    ]
    scale = 1.0 if "gemma3" in str(getattr(text, "model_type", "")) else max(factors, default=1.0)
    return max(int(limit * scale), explicit or 0)


def check_sequence_length(config: Any, length: int, *, what: str = "input_ids") -> None:
    """Raise ``ValueError`` when ``length`` exceeds the model's positions (``max_positions``)."""
    limit = max_positions(config)
    if limit is not None and length > limit:
        raise ValueError(f"{what}: sequence length {length} exceeds the model's maximum of {limit} positions")


def attn_implementation(config: Any) -> str | None:
    """The attention kernel a loaded transformers model runs (``sdpa``, ``eager``, ``flash_attention_2``...)."""
    return getattr(config, "_attn_implementation", None)


def zero_stage(ds_config: dict[str, Any] | None) -> int:
    """The ZeRO stage a DeepSpeed config dict asks for (0 without one)."""
    return int((ds_config or {}).get("zero_optimization", {}).get("stage", 0))


def check_compile(options: ModelOptions, ds_config: dict[str, Any] | None) -> None:
    """Refuse ``options.compile`` under ZeRO-3 (before anything loads)."""
    if options.compile and zero_stage(ds_config) == 3:
        raise ValueError(
            "compile: torch.compile does not trace ZeRO-3's parameter gathering; use zero_stage <= 2"
        )


def compile_model(model: torch.nn.Module, options: ModelOptions) -> None:
    """``torch.compile`` ``model`` in place when ``options.compile`` (``Module.compile``: the module and its
    state-dict keys stay as they are). Dynamic shapes from the start: the rows' count and width change
    every step, and one dynamic graph compiles once where static ones would recompile per shape."""
    if options.compile:
        model.compile(dynamic=True)


def input_positions(
    config: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> torch.Tensor | None:
    """Check the rows' length against ``config`` and return their position ids: ``position_ids`` as
    given (packed rows), else derived from a (right-padded) ``attention_mask``, else ``None``."""
    if position_ids is not None:
        check_sequence_length(config, int(position_ids.max()) + 1, what="position_ids")
        return position_ids
    check_sequence_length(config, input_ids.shape[1])
    if attention_mask is None:
        return None
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@contextlib.contextmanager
def zero3_construction(ds_config: dict[str, Any] | None, model_type: str) -> Iterator[None]:
    """Context in which ``from_pretrained`` / ``from_config`` build a ZeRO-3-partitioned model.

    For ZeRO-3 it registers the DeepSpeed config with transformers (``HfDeepSpeedConfig``), so that
    transformers constructs the model under ``deepspeed.zero.Init`` and loads each shard's weights.
    ``torch._dynamo`` and the model's transformers module are imported *before* that: imported inside
    ``zero.Init`` they fail with a signature mismatch. For other stages it does nothing.
    """
    if zero_stage(ds_config) != 3:
        yield
        return
    import torch._dynamo  # noqa: F401
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    with contextlib.suppress(ImportError):
        importlib.import_module(f"transformers.models.{model_type.replace('-', '_')}.modeling_{model_type}")
    keep = HfDeepSpeedConfig(ds_config)  # transformers holds only a weak reference to it
    try:
        yield
    finally:
        del keep
        unset_hf_deepspeed_config()
