"""What every training backend shares: ranks and their groups, seeding and RNG state, and writing a
full (gathered) model out parameter by parameter."""

from __future__ import annotations

import random
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlhf_learner.strategy.distributed import init_distributed
from rlhf_learner.strategy.export import DEFAULT_MAX_SHARD_BYTES, check_max_shard_bytes, write_hf_folder
from rlhf_learner.strategy.options import StrategyOptions

__all__ = ["RankedStrategy", "rng_state", "set_rng_state", "set_seed", "unwrap_hf_model"]


def set_seed(seed: int) -> None:
    """Seed python's and torch's generators (CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def rng_state() -> dict[str, Any]:
    """Python's and torch's generator states (CUDA's too where there is one)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def unwrap_hf_model(model: nn.Module) -> nn.Module:
    """The transformers (or peft) model inside an engine and/or a learner wrapper (``Actor``, ``Critic``,
    ``RewardModel``): the module whose parameter names are the Hugging Face checkpoint names, which is
    what a weight-sync sender should walk."""
    m = getattr(model, "module", model)
    return m if hasattr(m, "save_pretrained") else getattr(m, "model", m)


def _rank_file(directory: Path, tag: str, rank: int) -> Path:
    return directory / tag / f"rng_state_rank{rank}.pt"


class RankedStrategy:
    """Ranks, data- and sequence-parallel groups, RNG checkpoints and the Hugging Face export, shared by
    the backends (each adds how it wraps, gathers and checkpoints a model)."""

    name = ""

    def __init__(self, options: StrategyOptions) -> None:
        self.options = options
        self._sp_group: Any = None
        self._sp_ready = False

    @classmethod
    def check_options(cls, options: StrategyOptions) -> None:
        """Nothing to refuse beyond what ``StrategyOptions`` checks itself."""

    def setup_distributed(self, **kwargs: Any) -> tuple[int, int]:
        """:func:`init_distributed` with this strategy's timeout, seed every rank alike, and (with
        ``sequence_parallel_size > 1``) create the sequence-parallel groups: see
        :attr:`sequence_parallel_group`. Collective: every rank must call it."""
        out = init_distributed(timeout_s=self.options.timeout_s, **kwargs)
        set_seed(self.options.seed)
        self._check_world()
        self._sp_group = self._new_sequence_parallel_group()
        self._sp_ready = True
        return out

    def _check_world(self) -> None:
        split = self.options.tensor_parallel_size * self.options.sequence_parallel_size
        if self.world_size % split:
            raise ValueError(
                f"tensor_parallel_size * sequence_parallel_size = {split} does not divide the world size "
                f"{self.world_size}"
            )

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def data_parallel_size(self) -> int:
        """Distinct data shards: ``world_size / (tensor_parallel_size * sequence_parallel_size)``."""
        return self.world_size // (self.options.tensor_parallel_size * self.options.sequence_parallel_size)

    @property
    def data_parallel_rank(self) -> int:
        """The data shard this rank trains on. Ranks ``k*n .. k*n + n - 1`` (``n`` = tensor_parallel_size *
        sequence_parallel_size, consecutive blocks) share shard ``k``: they must get the same micro-batches."""
        return self.rank // (self.options.tensor_parallel_size * self.options.sequence_parallel_size)

    @property
    def sequence_parallel_group(self) -> Any:
        """This rank's sequence-parallel group (blocks of ``sequence_parallel_size`` consecutive ranks, made
        by :meth:`setup_distributed`), or None when ``sequence_parallel_size == 1``. Pass it to
        ``Actor(..., sequence_parallel_group=)``.

        Ranks of one group must get the same micro-batches (they split each sequence between them).
        The update steps need no change: the loss counts and the gradient average run over the whole
        world, and each rank's gradient carries ``sequence_parallel_size`` times its chunk's contribution
        (the backward of the differentiable gather sums over the group), so the average is the gradient
        of the data-parallel batch's loss."""
        if self.options.sequence_parallel_size == 1:
            return None
        if not self._sp_ready:
            raise RuntimeError(
                "sequence_parallel_group: call setup_distributed() first (it creates the groups)"
            )
        return self._sp_group

    def _new_sequence_parallel_group(self) -> Any:
        """Create every block's group (collective: ``new_group`` must be called alike on all ranks);
        return this rank's."""
        sp = self.options.sequence_parallel_size
        if sp == 1:
            return None
        if sp == self.world_size:
            return dist.group.WORLD
        mine = None
        for start in range(0, self.world_size, sp):
            group = dist.new_group(list(range(start, start + sp)))
            if start <= self.rank < start + sp:
                mine = group
        return mine

    def gather(self, params: Sequence[nn.Parameter]) -> AbstractContextManager[Any]:
        raise NotImplementedError

    # --- RNG state in checkpoints ----------------------------------------------------------------

    def _save_rng(self, directory: Path, tag: str) -> None:
        path = _rank_file(directory, tag, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), path)

    def _load_rng(self, directory: Path, tag: str) -> None:
        """This rank's generators as saved (a rank the checkpoint did not have keeps its own)."""
        path = _rank_file(directory, tag, self.rank)
        if path.is_file():
            set_rng_state(torch.load(path, weights_only=True))  # tensors, tuples and ints only

    @staticmethod
    def _resolve_tag(directory: Path, tag: str | None) -> str:
        if not directory.is_dir():
            raise ValueError(f"checkpoint folder {str(directory)!r} does not exist")
        if tag is not None:
            return tag
        latest = directory / "latest"
        if not latest.is_file():
            raise ValueError(f"checkpoint folder {str(directory)!r} has no 'latest' file; pass tag")
        return latest.read_text().strip()

    # --- export ----------------------------------------------------------------------------------

    def full_state_dict(
        self, model: nn.Module, *, prefix_to_strip: str = "", rank0_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """The full (gathered) weights of ``model`` as CPU tensors, one entry per distinct tensor
        (tied parameters appear once, under their first name), gathered one parameter at a time.
        Collective when the backend shards; every rank gets the dict, or with ``rank0_only`` only rank 0
        (the others take part in each gather and get ``{}``, holding no copy)."""
        keep = not rank0_only or self.rank == 0
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            with self.gather([p]) as full:
                if keep:
                    t = p if full is None else full[0]
                    out[name.removeprefix(prefix_to_strip)] = t.detach().to("cpu", copy=True).contiguous()
        if not keep:
            return out
        for name, b in model.named_buffers():
            if name.endswith("inv_freq"):
                continue
            out.setdefault(name.removeprefix(prefix_to_strip), b.detach().to("cpu", copy=True).contiguous())
        return out

    def export_hf(
        self,
        model: nn.Module,
        directory: str | Path,
        *,
        tokenizer: Any = None,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> Path:
        """Write a Hugging Face folder: safetensors weights, config (recording the weights' dtype),
        generation config and tokenizer.

        The weights go to one ``model.safetensors`` up to ``max_shard_bytes`` (default 5 GiB), else to
        ``model-0000i-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``. ``dtype``
        (e.g. ``torch.bfloat16``) casts the floating-point weights. ``model`` is the engine's module
        or a wrapper holding the transformers model as ``.model`` (actor, critic, reward model); a peft
        LoRA model is merged first (on a copy of the weights, the trained model is unchanged); a QLoRA
        model's 4-bit base is dequantized for that, and written in the compute dtype (bf16) unless
        ``dtype`` says otherwise, without its ``quantization_config``.
        Collective when the backend shards: every rank takes part in the gathers, but only rank 0 keeps
        the weights and touches ``directory`` (the other ranks' ``directory`` is not used).
        """
        check_max_shard_bytes(max_shard_bytes)  # on every rank, before any collective
        hf = unwrap_hf_model(model)
        base = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
        if getattr(base, "is_loaded_in_4bit", False) and not hasattr(hf, "peft_config"):
            raise ValueError(
                "load_in_4bit: export_hf writes a 4-bit base only merged with its LoRA adapter (a peft model)"
            )
        state = self.full_state_dict(hf, rank0_only=True)
        if self.rank == 0:
            if hasattr(hf, "peft_config"):
                from rlhf_learner.lora import merged_state_dict

                state, hf = merged_state_dict(hf, state)
            if dtype is not None:
                state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            write_hf_folder(directory, state, hf, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes)
        if dist.is_initialized():
            dist.barrier()
        return Path(directory)

    # --- memory ----------------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, float]:
        """This rank's memory in GiB: ``rss`` (host), and ``device_allocated`` / ``device_peak`` on CUDA."""
        import psutil

        out = {"rss": psutil.Process().memory_info().rss / 2**30}
        if torch.cuda.is_available():
            out["device_allocated"] = torch.cuda.memory_allocated() / 2**30
            out["device_peak"] = torch.cuda.max_memory_allocated() / 2**30
        return out
