"""The ``deepspeed`` training backend: ZeRO 0-3 (and AutoTP) engines, gathers and checkpoints."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlhf_learner.strategy._base import RankedStrategy
from rlhf_learner.strategy.offload import offload_states, reload_states
from rlhf_learner.strategy.options import StrategyOptions, build_ds_config, require_autotp, require_muon
from rlhf_learner.strategy.registry import register_training_backend
from rlhf_learner.strategy.schedule import make_lr_scheduler

__all__ = ["Strategy", "gather_params"]


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


def mark_full_shapes(model: nn.Module) -> None:
    """Give every DeepSpeed AutoTP shard of ``model`` its whole shape as ``rlhf_full_shape`` (what a weight
    sync plans with before :func:`gather_params`), gathering each sharded layer once, the first time.
    Collective over the tensor-parallel group, like the gather."""
    for layer in model.modules():
        shards = [p for p in layer.parameters(recurse=False) if getattr(p, "ds_is_replaced_module", False)]
        if not shards or all(hasattr(p, "rlhf_full_shape") for p in shards):
            continue
        with gather_params(shards):
            shapes = [tuple(p.shape) for p in shards]
        for p, shape in zip(shards, shapes, strict=True):
            p.rlhf_full_shape = shape  # type: ignore[attr-defined]


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


@register_training_backend("deepspeed")
class Strategy(RankedStrategy):
    """One DeepSpeed setup for the models of a job (the ``deepspeed`` training backend).

    Typical use::

        strategy = Strategy(StrategyOptions(zero_stage=3))
        strategy.setup_distributed()
        actor = Actor(
            load_causal_lm(path, ds_config=strategy.ds_config()),
            sequence_parallel_group=strategy.sequence_parallel_group,  # None unless sequence_parallel_size > 1
        )
        engine = strategy.prepare(actor)
    """

    @classmethod
    def check_options(cls, options: StrategyOptions) -> None:
        """Muon and AutoTP need a DeepSpeed that has them."""
        if options.optimizer == "muon":
            require_muon()
        if options.tensor_parallel_size > 1:
            require_autotp()

    reshards_checkpoints = False
    """DeepSpeed's ZeRO checkpoints load on the rank count that wrote them."""

    @classmethod
    def sharding_stage(cls, options: StrategyOptions, *, train: bool) -> int:
        return options.zero_stage

    @classmethod
    def gathers_in_forward(cls, options: StrategyOptions) -> bool:
        return options.zero_stage == 3  # ZeRO-3 fetches each module's partitioned parameters

    @classmethod
    def describe(cls, options: StrategyOptions) -> str:
        return f"ZeRO-{options.zero_stage}"

    def ds_config(self, *, train: bool = True) -> dict[str, Any]:
        """The DeepSpeed config for a trained (``train=True``) or inference-only model."""
        config = build_ds_config(self.options, train=train)
        self._check_world()
        return config

    def loader_config(self, *, train: bool = True) -> dict[str, Any]:
        """The model loaders' ``ds_config``: :meth:`ds_config` (ZeRO-3 builds the model partitioned)."""
        return self.ds_config(train=train)

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
        self._save_rng(directory, tag)
        if dist.is_initialized():
            dist.barrier()
        return directory / tag

    def load_checkpoint(self, engine: Any, directory: str | Path, *, tag: str | None = None) -> dict:
        """Load what :meth:`save_checkpoint` wrote (``tag=None``: the latest) and restore this rank's RNG
        state; returns the caller's ``client_state``."""
        directory = Path(directory)
        tag = self._resolve_tag(directory, tag)
        path, state = engine.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise ValueError(f"no checkpoint {tag!r} in {str(directory)!r}")
        self._load_rng(directory, tag)
        return dict((state or {}).get("caller", {}))

    # --- hybrid engine ---------------------------------------------------------------------------

    def offload_states(self, engine: Any) -> str:
        """See :func:`rlhf_learner.strategy.offload.offload_states`."""
        return offload_states(engine)

    def reload_states(self, engine: Any) -> str:
        return reload_states(engine)
