"""The DeepSpeed strategy: build, wrap, gather, checkpoint and export models."""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlhf_learner.strategy.distributed import init_distributed
from rlhf_learner.strategy.export import DEFAULT_MAX_SHARD_BYTES, check_max_shard_bytes, write_hf_folder
from rlhf_learner.strategy.options import StrategyOptions, build_ds_config
from rlhf_learner.strategy.schedule import make_lr_scheduler

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
        actor = Actor(
            load_causal_lm(path, ds_config=strategy.ds_config()),
            sequence_parallel_group=strategy.sequence_parallel_group,  # None unless sequence_parallel_size > 1
        )
        engine = strategy.prepare(actor)
    """

    def __init__(self, options: StrategyOptions) -> None:
        self.options = options
        self._sp_group: Any = None
        self._sp_ready = False

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
        sequence_parallel_size, consecutive blocks, as DeepSpeed's AutoTP groups are too) share shard ``k``:
        they must get the same micro-batches."""
        return self.rank // (self.options.tensor_parallel_size * self.options.sequence_parallel_size)

    def ds_config(self, *, train: bool = True) -> dict[str, Any]:
        """The DeepSpeed config for a trained (``train=True``) or inference-only model."""
        config = build_ds_config(self.options, train=train)
        self._check_world()
        return config

    @property
    def sequence_parallel_group(self) -> Any:
        """This rank's sequence-parallel group (blocks of ``sequence_parallel_size`` consecutive ranks, made
        by :meth:`setup_distributed`), or None when ``sequence_parallel_size == 1``. Pass it to
        ``Actor(..., sequence_parallel_group=)``.

        Ranks of one group must get the same micro-batches (they split each sequence between them).
        The update steps need no change: the loss counts and DeepSpeed's gradient average run over the
        whole world, and each rank's gradient carries ``sequence_parallel_size`` times its chunk's
        contribution (the backward of the differentiable gather sums over the group), so the average is
        the gradient of the data-parallel batch's loss."""
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

    def prepare(
        self,
        model: nn.Module,
        *,
        train: bool = True,
        optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    ) -> Any:
        """Wrap ``model`` in a DeepSpeed engine. ``optimizer``: a torch optimizer (or a factory taking the
        parameters) instead of the configured one. ``train=False`` gives an inference engine in eval mode.
        A training engine steps ``options.lr_schedule`` once per optimizer step (its state is saved with
        checkpoints); in bf16 on a one-rank world at ZeRO stage 0 it skips the gradient all-reduce."""
        import deepspeed

        if not dist.is_initialized():
            raise RuntimeError("call setup_distributed() (or init_distributed()) before prepare()")
        self._check_model(model)
        config = self.ds_config(train=train)
        if optimizer is not None:
            config.pop("optimizer", None)
        params = [p for p in model.parameters() if p.requires_grad] if train else None
        schedule = self.options.lr_schedule
        scheduler = (
            None
            if not train or schedule.is_identity
            else functools.partial(make_lr_scheduler, schedule=schedule)
        )
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=params,
            optimizer=optimizer if train else None,
            lr_scheduler=scheduler,
            config=config,
        )
        if not train:
            engine.eval()
        elif self.world_size == 1 and self.options.zero_stage == 0 and self.options.precision == "bf16":
            # One rank: DeepSpeed would still flatten every gradient, all-reduce it over a group of one
            # and copy it back after each backward (~5% of a 23M bf16 update on 2 CPU cores). bf16 only:
            # its optimizer wrapper gives a parameter without a gradient a zero one, as the all-reduce
            # does (fp32's plain optimizer would skip it: no weight decay for an unrouted expert).
            engine.enable_backward_allreduce = False
        return engine

    def _check_model(self, model: nn.Module) -> None:
        """Refuse what these options cannot run: a LoRA model under AutoTP, 4-bit weights under ZeRO-3."""
        modules = list(model.modules())
        if self.options.tensor_parallel_size > 1 and any(hasattr(m, "peft_config") for m in modules):
            raise ValueError(
                "tensor_parallel_size > 1 with a LoRA model: DeepSpeed AutoTP cannot train peft adapters here"
            )
        if self.options.zero_stage == 3 and any(getattr(m, "is_loaded_in_4bit", False) for m in modules):
            raise ValueError(
                "load_in_4bit with zero_stage=3: ZeRO-3 cannot shard 4-bit weights; use zero_stage 0-2"
            )

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
            _set_rng_state(torch.load(rank_file, weights_only=True))  # tensors, tuples and ints only
        return dict((state or {}).get("caller", {}))

    # --- export --------------------------------------------------------------------------------

    def full_state_dict(
        self, model: nn.Module, *, prefix_to_strip: str = "", rank0_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """The full (gathered) weights of ``model`` as CPU tensors, one entry per distinct tensor
        (tied parameters appear once, under their first name). Collective under ZeRO-3 / AutoTP; every
        rank gets the dict, or with ``rank0_only`` only rank 0 (the others take part in each gather and
        get ``{}``, holding no copy)."""
        keep = not rank0_only or self.rank == 0
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            with gather_params([p]):
                if keep:
                    out[name.removeprefix(prefix_to_strip)] = p.detach().to("cpu", copy=True).contiguous()
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
        Collective under ZeRO-3 / AutoTP: every rank takes part in the gathers, but only rank 0 keeps
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
