"""Merging LoRA into a QLoRA model: every bitsandbytes 4-bit NF4 base weight is dequantized, the adapter
delta ``scaling * B @ A`` (peft's ``get_delta_weight``) is added, and the result is written under the
plain names the base model (and vLLM) load, in the compute dtype (bf16).

The name and key helpers are pure functions on state-dict keys; only :func:`merged_4bit_state_dict`
needs bitsandbytes (and the CUDA device the 4-bit weights live on)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "PEFT_PREFIX",
    "adapter_deltas",
    "four_bit_layers",
    "is_adapter_key",
    "is_quant_state_key",
    "lora_delta",
    "merged_4bit_state_dict",
    "plain_name",
    "plain_state",
    "qlora_compute_dtype",
]

PEFT_PREFIX = "base_model.model."
"""What peft puts in front of every name of the model it wraps."""

_QUANT_STATE_KEY = re.compile(
    r"\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\.bitsandbytes__\w+)$"
)
"""The entries ``bnb.nn.Linear4bit`` adds to a state dict beside its packed weight (``QuantState.as_dict``)."""


def plain_name(name: str) -> str:
    """The base model's name of a peft parameter or module name: ``base_model.model.`` removed and the
    LoRA wrapper's ``base_layer`` level dropped (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``)."""
    name = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
    return name.removesuffix(".base_layer")


def is_adapter_key(name: str) -> bool:
    """A LoRA tensor (``lora_A``, ``lora_B``, ``lora_embedding_*``, ``lora_magnitude_vector``)."""
    return ".lora_" in name


def is_quant_state_key(name: str) -> bool:
    """A bitsandbytes 4-bit quantization-state entry (``weight.absmax``, ``weight.quant_map``,
    ``weight.nested_*``, ``weight.quant_state.bitsandbytes__nf4``), not a weight."""
    return _QUANT_STATE_KEY.search(name) is not None


def plain_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without adapter tensors and quantization-state entries, under the base model's names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter_key(name) or is_quant_state_key(name):
            continue
        key = plain_name(name)
        if key in out:
            raise ValueError(f"load_in_4bit: two tensors of the state dict map to the base model's {key!r}")
        out[key] = tensor
    return out


def lora_delta(
    lora_b: torch.Tensor, lora_a: torch.Tensor, scaling: float, *, fan_in_fan_out: bool = False
) -> torch.Tensor:
    """peft's LoRA ``get_delta_weight``: ``transpose(B @ A, fan_in_fan_out) * scaling``, in fp32."""
    delta = lora_b.float() @ lora_a.float()
    return (delta.T if fan_in_fan_out else delta) * scaling


def _check_plain_lora(mod: nn.Module, adapter: str, mod_name: str) -> None:
    """Only plain LoRA merges as ``W + delta``: refuse DoRA and LoRA biases."""
    if getattr(mod, "use_dora", {}).get(adapter, False):
        raise ValueError(f"load_in_4bit: {mod_name} uses DoRA, which this merge does not support")
    if getattr(mod, "lora_bias", {}).get(adapter, False):
        raise ValueError(f"load_in_4bit: {mod_name} has a LoRA bias, which this merge does not support")


def adapter_deltas(peft_model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per adapted linear, under its plain weight name: the sum over its adapters of :func:`lora_delta`,
    with ``lora_A`` / ``lora_B`` read from ``state`` (names as in ``peft_model.named_parameters()``)."""
    deltas: dict[str, torch.Tensor] = {}
    for mod_name, mod in peft_model.named_modules():
        if not hasattr(mod, "lora_A") or not hasattr(mod, "scaling"):
            continue
        for adapter in mod.lora_A:
            _check_plain_lora(mod, adapter, mod_name)
            delta = lora_delta(
                state[f"{mod_name}.lora_B.{adapter}.weight"],
                state[f"{mod_name}.lora_A.{adapter}.weight"],
                mod.scaling[adapter],
                fan_in_fan_out=bool(getattr(mod, "fan_in_fan_out", False)),
            )
            key = f"{plain_name(mod_name)}.weight"
            deltas[key] = deltas[key] + delta if key in deltas else delta
    return deltas


def four_bit_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(plain weight name, layer)`` of every layer that owns a bitsandbytes 4-bit weight (``Params4bit``
    with its ``quant_state``); peft's wrappers, which only point at their base layer's weight, are skipped."""
    for mod_name, mod in model.named_modules():
        weight = mod._parameters.get("weight")
        if type(weight).__name__ == "Params4bit" and getattr(weight, "quant_state", None) is not None:
            yield f"{plain_name(mod_name)}.weight", mod


def qlora_compute_dtype(model: nn.Module) -> torch.dtype:
    """The compute dtype of ``model``'s 4-bit layers (``bnb_4bit_compute_dtype``); bf16 when unset."""
    for _, layer in four_bit_layers(model):
        dtype = getattr(layer, "compute_dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return torch.bfloat16


def _dequantize(weight: Any) -> torch.Tensor:
    """The full-precision values of a bitsandbytes ``Params4bit`` (on its device)."""
    try:
        from bitsandbytes.functional import dequantize_4bit
    except ImportError as err:
        raise ValueError(f"load_in_4bit: merging 4-bit weights needs bitsandbytes ({err})") from err
    return dequantize_4bit(weight.data, weight.quant_state)


def merged_4bit_state_dict(
    peft_model: nn.Module, state: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The merged full-precision state dict of a QLoRA peft model, as CPU tensors under the base model's
    names: each 4-bit weight dequantized from the live layer (``state`` holds only its packed bytes) plus
    its adapter delta (summed in fp32), adapter tensors and quantization-state entries dropped, and every
    floating tensor in ``dtype`` (default: the compute dtype, bf16). ``state``: the full state of
    ``peft_model`` (names as in its ``named_parameters()``, e.g. ``Strategy.full_state_dict``); the model
    and ``state`` are not changed."""
    out = plain_state(state)
    deltas = adapter_deltas(peft_model, state)
    dtype = dtype or qlora_compute_dtype(peft_model)
    for key, layer in four_bit_layers(peft_model):
        if key not in out:
            raise ValueError(f"load_in_4bit: the state dict has no {key!r} of the model's 4-bit layer")
        with torch.no_grad():
            full = _dequantize(layer.weight).float()
            delta = deltas.pop(key, None)
            if delta is not None:
                full += delta.to(full.device)
            out[key] = full.to(dtype).cpu()
    for key, delta in deltas.items():  # adapters on layers kept in full precision
        out[key] = out[key].float() + delta
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
