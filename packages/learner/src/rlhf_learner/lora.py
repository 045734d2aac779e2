"""LoRA via peft: wrap, save adapters, merge into the base model; QLoRA on GPU with bitsandbytes."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_learner.strategy.export import quiet_progress_bars

__all__ = [
    "LoraOptions",
    "apply_lora",
    "check_4bit",
    "check_adapter_matches",
    "load_qlora_base",
    "merge_adapter",
    "merged_state_dict",
    "save_adapter",
]


@dataclass(kw_only=True)
class LoraOptions:
    """Low-rank adapters (Hu et al., 2021, arXiv:2106.09685)."""

    rank: int = 8
    """Adapter rank ``r``."""
    alpha: float = 16.0
    """Scaling numerator: the update is ``(alpha / r) * B A``."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: Sequence[str] | str = field(default_factory=lambda: "all-linear")
    """Module names to adapt (peft's ``target_modules``; ``all-linear`` = every linear but the output head)."""
    load_in_4bit: bool = False
    """4-bit NF4 base weights via bitsandbytes (QLoRA); needs a CUDA GPU. The base is quantized when it is
    loaded (``load_causal_lm(path, lora=options)``); ZeRO-3 cannot shard 4-bit weights (use stages 0-2)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora rank: expected a positive integer, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora alpha: expected a positive number, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout: expected a value in [0, 1), got {self.dropout}")


def apply_lora(model: nn.Module, options: LoraOptions, *, exclude: str | None = None) -> nn.Module:
    """A peft model whose only trainable parameters are the adapters. With ``options.load_in_4bit``
    ``model`` must be a 4-bit base (``load_causal_lm(path, lora=options)`` or :func:`load_qlora_base`).
    ``exclude``: a regular expression of module names to leave without adapters (a frozen vision tower)."""
    from peft import LoraConfig, get_peft_model

    if options.load_in_4bit and not getattr(model, "is_loaded_in_4bit", False):
        raise ValueError(
            "load_in_4bit: the base model was not loaded in 4 bit; load it with load_causal_lm(path, lora=options)"
        )

    targets = (
        options.target_modules if isinstance(options.target_modules, str) else list(options.target_modules)
    )
    if targets == ["all-linear"]:  # peft knows the keyword only as a plain string
        targets = "all-linear"
    config = LoraConfig(
        r=options.rank,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        exclude_modules=exclude,
    )
    return get_peft_model(model, config)


BASE_FINGERPRINT = "base_fingerprint.txt"
"""Beside an adapter: the fingerprint of the base weights it was trained on (``weights_fingerprint``)."""


def save_adapter(peft_model: nn.Module, directory: str | Path, *, state_dict: dict | None = None) -> Path:
    """Write the adapter (``adapter_config.json`` + ``adapter_model.safetensors``) only, and the base
    folder's ``weights_fingerprint`` beside it. ``state_dict``: the model's full weights, gathered (a
    sharded model's own parameters hold shards), whose adapter entries peft picks."""
    peft_model.save_pretrained(str(directory), state_dict=state_dict)
    base = _recorded_base(Path(directory))
    if base is not None and base.is_dir():
        (Path(directory) / BASE_FINGERPRINT).write_text(weights_fingerprint(base) + "\n")
    return Path(directory)


def weights_fingerprint(model_dir: str | Path, *, sample_bytes: int = 1 << 16) -> str:
    """A hash of a Hugging Face folder's safetensors files: each one's header (names, dtypes, shapes) and
    ``sample_bytes`` from the start, middle and end of its data. Two checkpoints of one architecture
    differ in it; reading it costs a few reads per file, whatever the model's size. Empty for a folder
    without safetensors files (``.bin`` weights: nothing to compare)."""
    import hashlib
    import struct

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return ""
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            digest.update(f.read(n))
            size = file.stat().st_size - 8 - n
            for at in sorted({0, max(0, size // 2 - sample_bytes // 2), max(0, size - sample_bytes)}):
                f.seek(8 + n + at)
                digest.update(f.read(sample_bytes))
    return digest.hexdigest()


def _recorded_base(adapter_dir: Path) -> Path | None:
    """The base folder ``adapter_config.json`` names (``base_model_name_or_path``), if it names one."""
    import json

    name = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    return Path(name) if name else None


def check_trained_base(base_dir: Path, adapter_dir: Path) -> None:
    """Raise a one-line ValueError when the adapter was trained on other weights than ``base_dir``'s: its
    saved fingerprint, else its recorded base folder's, differs from ``base_dir``'s (nothing recorded, or
    a recorded folder that is gone: nothing to compare, accepted)."""
    saved = adapter_dir / BASE_FINGERPRINT
    recorded = _recorded_base(adapter_dir)
    if saved.is_file():
        expected = saved.read_text().strip()
    elif recorded is not None and recorded.is_dir() and recorded.resolve() != base_dir.resolve():
        expected = weights_fingerprint(recorded)
    else:
        return
    given = weights_fingerprint(base_dir)
    if expected and given and given != expected:
        raise ValueError(
            f"adapter {str(adapter_dir)!r} was trained on {str(recorded)!r}, whose weights are not those of "
            f"{str(base_dir)!r}: merge it into the base it was trained on (--force merges anyway)"
        )


def merge_adapter(
    base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, *, force: bool = False
) -> Path:
    """Load the base folder, apply the adapter, merge ``W + (alpha/r) B A`` into the weights and save
    a plain Hugging Face folder (with the base's tokenizer when it has one). ``force``: merge into a base
    whose weights are not those the adapter was trained on."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_adapter_matches(base_dir, adapter_dir, force=force)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)  # merge in fp32
    saved_dtype = _config_dtype(base_dir)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged = merged.to(saved_dtype)  # written in the base folder's dtype (a bf16 base stays bf16)
    with quiet_progress_bars():  # one line from the CLI says where it went
        merged.save_pretrained(str(out_dir), safe_serialization=True)
    with contextlib.suppress(OSError, ValueError):  # a base folder without a tokenizer is fine
        AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(out_dir))
    return Path(out_dir)


def _config_dtype(model_dir: str | Path) -> torch.dtype:
    """The weight dtype a Hugging Face folder declares (``dtype`` / ``torch_dtype``); float32 if none."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def check_adapter_matches(base_dir: str | Path, adapter_dir: str | Path, *, force: bool = False) -> None:
    """Raise a one-line ValueError unless every adapted module of ``adapter_dir`` exists in the base
    model of ``base_dir`` with the shapes the adapter was trained on (read from the configs and the
    adapter file; the base's weights are not loaded) and, unless ``force``, the base's weights are
    those it was trained on (``check_trained_base``)."""
    import json

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    for p, what in ((base_dir, "base model"), (adapter_dir, "adapter")):
        if not p.is_dir():
            raise ValueError(f"{what} folder {str(p)!r} does not exist")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ValueError(
            f"adapter folder {str(adapter_dir)!r} has no adapter_config.json (not a peft adapter)"
        )
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"adapter folder {str(adapter_dir)!r} has no adapter_model.safetensors")
    peft_type = json.loads((adapter_dir / "adapter_config.json").read_text()).get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"adapter {str(adapter_dir)!r} is a {peft_type} adapter, not LoRA")
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(base_dir)))
    modules = dict(base.named_modules())
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if ".lora_A." not in key and ".lora_B." not in key:
                continue
            name = key.removeprefix("base_model.model.").split(".lora_")[0]
            mod = modules.get(name)
            shape = tuple(f.get_slice(key).get_shape())
            if mod is None or not hasattr(mod, "in_features"):
                raise ValueError(
                    f"adapter {str(adapter_dir)!r} adapts {name!r}, which the base model {str(base_dir)!r} "
                    "does not have as a linear layer: it was trained on another base"
                )
            want = mod.in_features if ".lora_A." in key else mod.out_features
            got = shape[1] if ".lora_A." in key else shape[0]
            if got != want:
                raise ValueError(
                    f"adapter {str(adapter_dir)!r} tensor {key} has shape {list(shape)}, but {name} in the base "
                    f"model {str(base_dir)!r} has {want} {'inputs' if '.lora_A.' in key else 'outputs'}: it was "
                    "trained on another base"
                )
    if not force:  # the shapes fit: the weights may still be another checkpoint's
        check_trained_base(base_dir, adapter_dir)


def merged_state_dict(peft_model: Any, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
    """Fold LoRA weights of a full ``state`` (names as in ``peft_model.named_parameters()``) into the
    base weights: ``W += scale * B @ A`` per adapted linear. Returns the base model's state dict
    (peft prefixes removed, adapter tensors dropped) and the base model (for its config).

    A QLoRA model (4-bit NF4 base) is merged by :func:`~rlhf_learner.qlora_merge.merged_4bit_state_dict`:
    each 4-bit weight dequantized from the live layer plus its delta, every floating tensor in the compute
    dtype (bf16), bitsandbytes' quantization-state entries dropped."""
    base = peft_model.get_base_model()
    if getattr(base, "is_loaded_in_4bit", False):
        from rlhf_learner.qlora_merge import merged_4bit_state_dict

        return merged_4bit_state_dict(peft_model, state), base
    out: dict[str, torch.Tensor] = {}
    prefix = "base_model.model."
    for name, t in state.items():
        if ".lora_" in name:
            continue
        out[name.removeprefix(prefix).replace(".base_layer.", ".")] = t.clone()
    for mod_name, mod in peft_model.named_modules():
        if not hasattr(mod, "lora_A") or not hasattr(mod, "scaling"):
            continue
        for adapter in mod.lora_A:
            a = state[f"{mod_name}.lora_A.{adapter}.weight"]
            b = state[f"{mod_name}.lora_B.{adapter}.weight"]
            key = f"{mod_name.removeprefix(prefix)}.weight"
            out[key] = out[key] + (b.float() @ a.float()).to(out[key].dtype) * mod.scaling[adapter]
    return out, base


def check_4bit(*, zero_stage: int | None = None) -> None:
    """Raise a one-line ValueError naming ``load_in_4bit`` unless 4-bit NF4 weights can be used here:
    not with ZeRO-3 (it cannot shard 4-bit weights), and only with CUDA and bitsandbytes."""
    if zero_stage == 3:
        raise ValueError(
            "load_in_4bit with zero_stage=3: ZeRO-3 cannot shard 4-bit weights; use zero_stage 0-2"
        )
    if not torch.cuda.is_available():
        raise ValueError("load_in_4bit: 4-bit NF4 weights (bitsandbytes) need a CUDA GPU; none is present")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("load_in_4bit: needs the bitsandbytes package (the rlhf-learner[qlora] extra)")


def load_qlora_base(
    path: str | Path,
    *,
    compute_dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    model_class: Any = None,
) -> nn.Module:
    """A 4-bit NF4 base model for QLoRA (Dettmers et al., 2023, arXiv:2305.14314) on this process's CUDA
    device, prepared for training with peft's ``prepare_model_for_kbit_training`` (base frozen, the
    other weights in fp32). Needs CUDA and bitsandbytes (see :func:`check_4bit`). Wrap it with
    :func:`apply_lora` afterwards; ``load_causal_lm(path, lora=LoraOptions(load_in_4bit=True))`` does both."""
    check_4bit()
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    cls = model_class or AutoModelForCausalLM
    model = cls.from_pretrained(
        str(path),
        quantization_config=quant,
        dtype=compute_dtype,
        attn_implementation=attn_implementation,
        device_map={"": torch.cuda.current_device()},
    )
    return prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
