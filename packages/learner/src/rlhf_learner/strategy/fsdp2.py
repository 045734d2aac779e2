"""The ``fsdp2`` training backend: torch's ``fully_shard`` per decoder layer and on the root, mixed
precision, CPU offload, ``torch.distributed.checkpoint`` checkpoints (resharded on load), and gathers one
parameter (or one weight-sync bucket) at a time.

How ``StrategyOptions`` read here: ``zero_stage`` 3 frees each layer's gathered parameters after its
forward (``reshard_after_forward``) and reduce-scatters gradients after every micro-batch, so parameters,
gradients and optimizer states stay sharded (ZeRO-3's memory); 0-2 keep the gathered parameters from a
layer's forward to its backward and accumulate whole gradients until the window's last micro-batch
(less traffic; ZeRO-1's peak memory). ``precision`` ``bf16`` computes in bf16 over fp32 sharded
parameters and reduces gradients in fp32 (``MixedPrecisionPolicy``). ``offload_params`` keeps
parameters, gradients and the optimizer step on the host (``CPUOffloadPolicy``; on GPUs the process
group then carries gloo for CPU tensors beside NCCL).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlhf_learner.strategy._base import RankedStrategy
from rlhf_learner.strategy.options import StrategyOptions
from rlhf_learner.strategy.registry import register_training_backend
from rlhf_learner.strategy.schedule import make_lr_scheduler

__all__ = ["FSDP2Engine", "FSDP2Strategy"]

_ENGINE_STATE = "engine_state.pt"


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@contextlib.contextmanager
def _full_tensors(params: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Each parameter whole: a DTensor's shards all-gathered (collective over its mesh), others as they are."""
    yield [p.full_tensor() if _is_dtensor(p) else p for p in params]


class FSDP2Engine:
    """A model under ``fully_shard`` with its optimizer and LR scheduler, shaped as the update steps'
    ``TrainEngine``: ``backward`` and ``step`` once per micro-batch; the window's last ``step`` clips,
    steps the optimizer and the schedule. Gradients are reduce-scattered after every micro-batch at
    zero_stage 3, else on the window's last only."""

    reports_grad_norm = True
    """``get_global_grad_norm`` gives every optimizer step's norm (measured while clipping)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any,
        options: StrategyOptions,
        device: torch.device,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.device = device
        self._options = options
        self._micro_steps = 0
        self._grad_norm: float | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train(self, mode: bool = True) -> FSDP2Engine:
        self.module.train(mode)
        return self

    def eval(self) -> FSDP2Engine:
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def gradient_accumulation_steps(self) -> int:
        return self._options.grad_accum_steps

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken."""
        return self._micro_steps // self._options.grad_accum_steps

    def _at_boundary(self) -> bool:
        return (self._micro_steps + 1) % self._options.grad_accum_steps == 0

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> None:
        """Backward of one micro-batch's loss (divided by the accumulation steps when ``scale_wrt_gas``)."""
        if self.optimizer is None:
            raise RuntimeError("backward: this engine was prepared for inference (train=False)")
        if scale_wrt_gas:
            loss = loss / self._options.grad_accum_steps
        if hasattr(self.module, "set_requires_gradient_sync"):  # stage 3: sharded gradients throughout
            self.module.set_requires_gradient_sync(self._options.zero_stage == 3 or self._at_boundary())
        loss.backward()

    def step(self) -> None:
        """End a micro-batch; at the window's last one clip the gradient norm and step the optimizer and
        the LR schedule."""
        boundary = self._at_boundary()
        self._micro_steps += 1
        if not boundary:
            return
        params = [p for p in self.module.parameters() if p.grad is not None]
        clip = self._options.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip if clip is not None else math.inf)
        if _is_dtensor(norm):
            norm = norm.full_tensor()
        self._grad_norm = float(norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def get_global_grad_norm(self) -> float | None:
        """The last optimizer step's gradient norm before clipping (over every rank's shards)."""
        return self._grad_norm

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []


@register_training_backend("fsdp2")
class FSDP2Strategy(RankedStrategy):
    """torch FSDP2 for the models of a job (the ``fsdp2`` training backend).

    Typical use::

        strategy = FSDP2Strategy(StrategyOptions(backend="fsdp2", zero_stage=3))
        strategy.setup_distributed()
        engine = strategy.prepare(Actor(load_causal_lm(path)))
    """

    @classmethod
    def check_options(cls, options: StrategyOptions) -> None:
        if options.tensor_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size: tensor-parallel training (AutoTP) is in the deepspeed backend only"
            )
        if options.optimizer != "adamw":
            raise ValueError(
                f"optimizer: {options.optimizer} is in the deepspeed backend only; fsdp2 has adamw"
            )
        if options.offload_optimizer and not options.offload_params:
            raise ValueError(
                "offload_optimizer: fsdp2 offloads parameters, gradients and optimizer states together: "
                "set offload_params (with zero_stage 3)"
            )

    reshards_checkpoints = True
    """``torch.distributed.checkpoint`` loads onto any rank count."""

    @classmethod
    def gathers_in_forward(cls, options: StrategyOptions) -> bool:
        return True  # every stage keeps parameters sharded at rest: a unit's first forward gathers them

    @classmethod
    def sharding_stage(cls, options: StrategyOptions, *, train: bool) -> int:
        """At its peak: zero_stage 3 keeps everything sharded; a trained model at 0-2 holds whole
        parameters (gathered for the backward) and gradients (accumulated), its optimizer states sharded;
        a frozen one at 0-2 is a replica."""
        if options.zero_stage == 3:
            return 3
        return 1 if train else 0

    @classmethod
    def describe(cls, options: StrategyOptions) -> str:
        return "FSDP2 full shard" if options.zero_stage == 3 else "FSDP2 (layers kept for backward)"

    def setup_distributed(self, **kwargs: Any) -> tuple[int, int]:
        """As every backend's, with gloo beside NCCL on GPUs when parameters are offloaded to the host."""
        if torch.cuda.is_available() and self.options.offload_params and "backend" not in kwargs:
            from rlhf_learner.strategy.distributed import CPU_AND_CUDA

            kwargs["backend"] = CPU_AND_CUDA
        return super().setup_distributed(**kwargs)

    def loader_config(self, *, train: bool = True) -> None:
        """None: models are built whole on each rank and sharded by :meth:`prepare`."""
        return None

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(_device().type, (self.world_size,))

    def _shard_kwargs(self, *, train: bool) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        o = self.options
        kw: dict[str, Any] = {"mesh": self._mesh(), "reshard_after_forward": o.zero_stage == 3 or not train}
        if o.precision == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if o.offload_params:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        return kw

    def prepare(
        self,
        model: nn.Module,
        *,
        train: bool = True,
        optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    ) -> FSDP2Engine:
        """Shard ``model`` (each decoder layer, named by the transformers model's ``_no_split_modules``,
        then the root) and build its AdamW and LR schedule. ``optimizer``: a factory taking the parameters
        (an optimizer built before sharding would hold the unsharded tensors). ``train=False`` gives an
        inference engine in eval mode, sharded only at ``zero_stage`` 3 (else every rank keeps a replica)."""
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            raise RuntimeError("call setup_distributed() (or init_distributed()) before prepare()")
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("optimizer: fsdp2 takes a factory of the parameters, not a built optimizer")
        self._check_model(model)
        device = _device()
        if train or self.options.zero_stage == 3:  # fully_shard moves each shard to the mesh's device itself
            kw = self._shard_kwargs(train=train)
            for layer in reversed(_decoder_layers(model)):  # innermost first
                fully_shard(layer, **kw)
            fully_shard(model, **kw)
        else:
            model.to(device)
            if self.options.precision == "bf16":
                model.to(torch.bfloat16)
        opt, scheduler = None, None
        if train:
            params = [p for p in model.parameters() if p.requires_grad]
            opt = optimizer(params) if optimizer is not None else self._adamw(params)
            schedule = self.options.lr_schedule
            scheduler = None if schedule.is_identity else make_lr_scheduler(opt, schedule)
        engine = FSDP2Engine(
            model, optimizer=opt, lr_scheduler=scheduler, options=self.options, device=device
        )
        return engine.train(train)

    def _adamw(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        o = self.options
        return torch.optim.AdamW(
            params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=True
        )

    def _check_model(self, model: nn.Module) -> None:
        if any(getattr(m, "is_loaded_in_4bit", False) for m in model.modules()):
            raise ValueError("load_in_4bit: fsdp2 cannot shard 4-bit weights here; use the deepspeed backend")

    def gather(self, params: Sequence[nn.Parameter]) -> AbstractContextManager[list[torch.Tensor]]:
        """A context yielding each of ``params`` whole (DTensor shards all-gathered; collective over the
        model's ranks), in order: the ``gather`` a weight-sync sender applies per bucket."""
        return _full_tensors(params)

    # --- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(
        self, engine: FSDP2Engine, directory: str | Path, *, tag: str, client_state: dict | None = None
    ) -> Path:
        """Save the sharded weights and optimizer state (``torch.distributed.checkpoint``: loadable on
        another number of ranks), the scheduler and step count, ``client_state`` and every rank's RNG
        state under ``directory/tag``, then point ``directory/latest`` at it. Collective."""
        import torch.distributed.checkpoint as dcp

        directory = Path(directory)
        path = directory / tag
        dcp.save(_app_state(engine), checkpoint_id=str(path))
        if self.rank == 0:
            extra = {
                "caller": dict(client_state or {}),
                "optimizer_steps": engine.global_steps,
                "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            }
            torch.save(extra, path / _ENGINE_STATE)
        self._save_rng(directory, tag)
        dist.barrier()  # every rank's files are written: only then is the checkpoint the latest
        if self.rank == 0:
            (directory / "latest").write_text(tag)
        dist.barrier()
        return path

    def load_checkpoint(self, engine: FSDP2Engine, directory: str | Path, *, tag: str | None = None) -> dict:
        """Load what :meth:`save_checkpoint` wrote (``tag=None``: the latest), resharded to this world,
        and restore this rank's RNG state; returns the caller's ``client_state``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        directory = Path(directory)
        tag = self._resolve_tag(directory, tag)
        path = directory / tag
        if not (path / _ENGINE_STATE).is_file():
            raise ValueError(f"no fsdp2 checkpoint {tag!r} in {str(directory)!r}")
        state = _app_state(engine)
        dcp.load(state, checkpoint_id=str(path))
        optim = state.get("optim")
        set_state_dict(
            engine.module,
            [engine.optimizer] if engine.optimizer is not None else [],
            model_state_dict=state["model"],
            optim_state_dict=optim if optim is not None else {},
        )
        extra = torch.load(path / _ENGINE_STATE, weights_only=False)  # our own file: plain Python state
        engine._micro_steps = int(extra["optimizer_steps"]) * engine.gradient_accumulation_steps()
        if engine.lr_scheduler is not None and extra["scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(extra["scheduler"])
        self._load_rng(directory, tag)
        return dict(extra["caller"])

    # --- hybrid engine ---------------------------------------------------------------------------

    def offload_states(self, engine: FSDP2Engine) -> str:
        """Parameters and optimizer states to host memory while colocated engines use the GPU."""
        why = _why_not_move(engine, self.options)
        if why is not None:
            return why
        _move_states(engine, torch.device("cpu"))
        torch.cuda.empty_cache()
        return "offloaded"

    def reload_states(self, engine: FSDP2Engine) -> str:
        why = _why_not_move(engine, self.options)
        if why is not None:
            return why
        _move_states(engine, engine.device)
        return "reloaded"


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one: those whose class a transformers model lists in
    ``_no_split_modules`` (its decoder layers), outermost first."""
    names: set[str] = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def _app_state(engine: FSDP2Engine) -> dict[str, Any]:
    """The engine's model (and optimizer) state dicts in ``torch.distributed.checkpoint``'s sharded form."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if engine.optimizer is None:
        return {"model": get_model_state_dict(engine.module)}
    model, optim = get_state_dict(engine.module, [engine.optimizer])
    return {"model": model, "optim": optim}


def _why_not_move(engine: FSDP2Engine, options: StrategyOptions) -> str | None:
    if not torch.cuda.is_available():
        return "skipped: on CPU the states are in host memory already"
    if options.offload_params:
        return "skipped: --ds.offload_params keeps the parameters in host memory already"
    return None


def _move_states(engine: FSDP2Engine, device: torch.device) -> None:
    """Every parameter's local shard, gradient and optimizer state tensor to ``device``."""
    engine.module.to(device)
    if engine.optimizer is None:
        return
    for state in engine.optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device, non_blocking=True)
