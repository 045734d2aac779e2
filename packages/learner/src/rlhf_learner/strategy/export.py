"""Writing a Hugging Face model folder from a full state dict: sharded safetensors, config, tokenizer."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_NAME",
    "check_max_shard_bytes",
    "quiet_progress_bars",
    "save_safetensors_shards",
    "weights_dtype",
    "write_hf_folder",
]

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
"""5 GiB: models up to that size get one ``model.safetensors``."""
INDEX_NAME = "model.safetensors.index.json"


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' progress bars (e.g. "Writing model shards") off for the body, as they were after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def check_max_shard_bytes(max_shard_bytes: int) -> None:
    """Raise a one-line ValueError unless ``max_shard_bytes`` is a positive integer."""
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: expected a positive number of bytes, got {max_shard_bytes!r}")


def _remove_old_weights(directory: Path) -> None:
    """Delete the weight files of an earlier export, so a folder never holds two layouts."""
    for pattern in ("model.safetensors", "model-*-of-*.safetensors", INDEX_NAME):
        for old in directory.glob(pattern):
            old.unlink()


def save_safetensors_shards(
    state: dict[str, torch.Tensor], directory: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """Write ``state`` as ``model.safetensors``, or, when it exceeds ``max_shard_bytes``, as
    ``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json`` (``metadata.total_size``
    and ``weight_map``: the layout transformers and vLLM load). Returns the weight file names.
    Weight files of an earlier export in ``directory`` are removed first. A tensor larger than
    ``max_shard_bytes`` gets a shard of its own."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    check_max_shard_bytes(max_shard_bytes)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(directory)
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_bytes
    )
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state[name].contiguous() for name in names}
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {
            "metadata": dict(split.metadata),
            "weight_map": dict(sorted(split.tensor_to_filename.items())),
        }
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return list(split.filename_to_tensors)


def weights_dtype(state: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The floating-point dtype that holds most of ``state``'s elements (None without floating tensors)."""
    counts: dict[torch.dtype, int] = {}
    for t in state.values():
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=lambda d: counts[d]) if counts else None


def _write_config(directory: Path, hf_model: Any, dtype: torch.dtype | None) -> None:
    """``config.json`` of ``hf_model``, recording ``dtype`` (the weights' dtype as written), without a
    ``quantization_config``: the weights written are never quantized (a QLoRA model is merged in full
    precision), and loaders would otherwise expect bitsandbytes' packed weights."""
    hf_model.config.save_pretrained(str(directory))
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    if dtype is None and "quantization_config" not in cfg:
        return
    cfg.pop("quantization_config", None)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        cfg["dtype"] = name
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_hf_folder(
    directory: str | Path,
    state: dict[str, torch.Tensor],
    hf_model: Any,
    *,
    tokenizer: Any = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a Hugging Face folder: ``state`` as (sharded) safetensors, ``hf_model``'s config (with the
    weights' dtype) and generation config, and ``tokenizer`` when given. Not collective: one process
    writes."""
    directory = Path(directory)
    save_safetensors_shards(state, directory, max_shard_bytes=max_shard_bytes)
    _write_config(directory, hf_model, weights_dtype(state))
    gen = getattr(hf_model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(str(directory))
        except ValueError as err:  # transformers refuses to save an invalid generation config
            warnings.warn(f"export_hf: generation_config.json not written: {err}", stacklevel=3)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory
