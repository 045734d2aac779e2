"""The DeepSpeed strategy: build, wrap, gather, checkpoint and export models."""

from __future__ import annotations

import contextlib
import json
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlhf_learner.strategy.distributed import init_distributed
from rlhf_learner.strategy.options import StrategyOptions, build_ds_config

__all__ = ["Strategy", "gather_params", "set_seed", "unwrap_hf_model"]


def set_seed(seed: int) -> None:
    """Seed python's and torch's generators (CPU and CUDA)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def gather_params(params: Sequence[nn.Parameter]) -> AbstractContextManager[None]:
    """Context in which ``params`` hold their full tensors (read-only: changes are not scattered back).

    Gathers ZeRO-3 partitions (``deepspeed.zero.GatheredParameters``) and DeepSpeed AutoTP shards
    (each sharded layer is gathered whole, as DeepSpeed's own consolidation does). Parameters that
    are neither pass through untouched. This is the ``gather`` callable a weight-sync sender takes: it
    is applied per bucket, so the whole model is never gathered at once. Collective: every rank of the
    model's group must enter it with the same parameters.
    """
    zero3 = [p for p in params if hasattr(p, "ds_id")]
    layers: dict[int, nn.Module] = {}
    for p in params:
        if getattr(p, "ds_is_replaced_module", False):
            owner = getattr(getattr(p, "gather_params", None), "__self__", None)
            if owner is None:
                raise RuntimeError("a tensor-parallel parameter has no owning layer to gather it")
            layers[id(owner)] = owner
    if not zero3 and not layers:
        return contextlib.nullcontext()
    return _gathered(zero3, list(layers.values()))


@contextlib.contextmanager
def _gathered(zero3: list[nn.Parameter], tp_layers: list[nn.Module]) -> Iterator[None]:
    import deepspeed

    with contextlib.ExitStack() as stack:
        if zero3:
            stack.enter_context(deepspeed.zero.GatheredParameters(zero3, modifier_rank=None))
        if tp_layers:
            from deepspeed.module_inject.layers import GatherReplacedLayerParams

            for layer in tp_layers:
                stack.enter_context(GatherReplacedLayerParams(list(layer.parameters(recurse=False)), layer))
        yield


def unwrap_hf_model(model: nn.Module) -> nn.Module:
    """The transformers (or peft) model inside a DeepSpeed engine and/or a learner wrapper
    (``Actor``, ``Critic``, ``RewardModel``): the module whose parameter names are the Hugging Face
    checkpoint names, which is what a weight-sync sender should walk."""
    m = getattr(model, "module", model)
    return m if hasattr(m, "save_pretrained") else getattr(m, "model", m)


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Strategy:
    """One DeepSpeed setup for the models of a job.

    Typical use::

        strategy = Strategy(StrategyOptions(zero_stage=3))
        strategy.setup_distributed()
        actor = Actor(load_causal_lm(path, ds_config=strategy.ds_config()))
        engine = strategy.prepare(actor)
    """

    def __init__(self, options: StrategyOptions) -> None:
        self.options = options

    def setup_distributed(self, **kwargs: Any) -> tuple[int, int]:
        """:func:`init_distributed` with this strategy's timeout, then seed every rank alike."""
        out = init_distributed(timeout_s=self.options.timeout_s, **kwargs)
        set_seed(self.options.seed)
        return out

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def ds_config(self, *, train: bool = True) -> dict[str, Any]:
        """The DeepSpeed config for a trained (``train=True``) or inference-only model."""
        config = build_ds_config(self.options, train=train)
        split = self.options.tensor_parallel_size * self.options.sequence_parallel_size
        if self.world_size % split:
            raise ValueError(
                f"world size {self.world_size} is not a multiple of "
                f"tensor_parallel_size * sequence_parallel_size = {split}"
            )
        return config

    def sequence_parallel_group(self) -> Any:
        """This rank's sequence-parallel group (blocks of ``sequence_parallel_size`` consecutive ranks),
        or None when ``sequence_parallel_size == 1``. Collective: every rank must call it.

        Ranks of one group must get the same micro-batches (they split each sequence between them).
        The update steps need no change: the loss counts and DeepSpeed's gradient average run over the
        whole world, and each rank's gradient carries ``sequence_parallel_size`` times its chunk's
        contribution (the backward of the differentiable gather sums over the group), so the average is
        the gradient of the data-parallel batch's loss."""
        sp = self.options.sequence_parallel_size
        if sp == 1:
            return None
        if self.world_size % sp:
            raise ValueError(f"sequence_parallel_size {sp} does not divide the world size {self.world_size}")
        if sp == self.world_size:
            return dist.group.WORLD
        mine = None
        for start in range(0, self.world_size, sp):
            group = dist.new_group(list(range(start, start + sp)))
            if start <= self.rank < start + sp:
                mine = group
        return mine

    def prepare(
        self,
        model: nn.Module,
        *,
        train: bool = True,
        optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    ) -> Any:
        """Wrap ``model`` in a DeepSpeed engine. ``optimizer``: a torch optimizer (or a factory taking the
        parameters) instead of the configured one. ``train=False`` gives an inference engine in eval mode."""
        import deepspeed

        if not dist.is_initialized():
            raise RuntimeError("call setup_distributed() (or init_distributed()) before prepare()")
        config = self.ds_config(train=train)
        if optimizer is not None:
            config.pop("optimizer", None)
        params = [p for p in model.parameters() if p.requires_grad] if train else None
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=optimizer if train else None, config=config
        )
        if not train:
            engine.eval()
        return engine

    @staticmethod
    def gather(params: Sequence[nn.Parameter]) -> AbstractContextManager[None]:
        """See :func:`gather_params`."""
        return gather_params(params)

    # --- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(
        self, engine: Any, directory: str | Path, *, tag: str, client_state: dict | None = None
    ) -> Path:
        """Save the engine (weights, optimizer, scheduler; sharded as trained) plus ``client_state``
        (plain caller state: step, data position, ...) and every rank's RNG state under
        ``directory/tag``. Collective: every rank must call it."""
        directory = Path(directory)
        engine.save_checkpoint(str(directory), tag=tag, client_state={"caller": dict(client_state or {})})
        rank_file = directory / tag / f"rng_state_rank{self.rank}.pt"
        rank_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(_rng_state(), rank_file)
        if dist.is_initialized():
            dist.barrier()
        return directory / tag

    def load_checkpoint(self, engine: Any, directory: str | Path, *, tag: str | None = None) -> dict:
        """Load what :meth:`save_checkpoint` wrote (``tag=None``: the latest) and restore this rank's RNG
        state; returns the caller's ``client_state``."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"checkpoint folder {str(directory)!r} does not exist")
        if tag is None:
            latest = directory / "latest"
            if not latest.is_file():
                raise ValueError(f"checkpoint folder {str(directory)!r} has no 'latest' file; pass tag")
            tag = latest.read_text().strip()
        path, state = engine.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise ValueError(f"no checkpoint {tag!r} in {str(directory)!r}")
        rank_file = directory / tag / f"rng_state_rank{self.rank}.pt"
        if rank_file.is_file():
            _set_rng_state(torch.load(rank_file, weights_only=False))
        return dict((state or {}).get("caller", {}))

    # --- export --------------------------------------------------------------------------------

    def full_state_dict(self, model: nn.Module, *, prefix_to_strip: str = "") -> dict[str, torch.Tensor]:
        """The full (gathered) weights of ``model`` as CPU tensors, one entry per distinct tensor
        (tied parameters appear once, under their first name). Collective under ZeRO-3; every rank
        gets the dict."""
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            with gather_params([p]):
                out[name.removeprefix(prefix_to_strip)] = p.detach().to("cpu", copy=True).contiguous()
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
    ) -> Path:
        """Write a Hugging Face folder (``model.safetensors`` + config + generation config + tokenizer).

        ``model`` is the engine's module or a wrapper holding the transformers model as ``.model``
        (actor, critic, reward model); a peft LoRA model is merged first (on a copy of the weights,
        the trained model is unchanged). Collective under ZeRO-3; rank 0 writes.
        """
        from safetensors.torch import save_file

        hf = unwrap_hf_model(model)
        state = self.full_state_dict(hf)
        if hasattr(hf, "peft_config"):
            from rlhf_learner.lora import merged_state_dict

            state, hf = merged_state_dict(hf, state)
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        directory = Path(directory)
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
            hf.config.save_pretrained(str(directory))
            if dtype is not None:
                cfg = json.loads((directory / "config.json").read_text())
                cfg["dtype"] = str(dtype).removeprefix("torch.")
                (directory / "config.json").write_text(json.dumps(cfg, indent=2))
            gen = getattr(hf, "generation_config", None)
            if gen is not None:
                try:
                    gen.save_pretrained(str(directory))
                except ValueError as err:  # transformers refuses to save an invalid generation config
                    warnings.warn(f"export_hf: generation_config.json not written: {err}", stacklevel=2)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(directory))
        if dist.is_initialized():
            dist.barrier()
        return directory
