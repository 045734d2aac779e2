"""The training-backend seam: what a learner rank needs of a backend, and the registry of backends.

A backend is a class built from :class:`~rlhf_learner.strategy.options.StrategyOptions`; it registers
itself under a name with :func:`register_training_backend` when its module is imported. Nothing outside
a backend's own module compares backend names: callers ask :func:`make_strategy` for the class that
``options.backend`` names, and the options ask the class whether it can run them.

A backend in another package reaches every process (Ray's learner workers too) through an entry point in
the ``rlhf.training_backends`` group naming its module: a name not registered yet loads those modules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rlhf_learner.strategy.options import StrategyOptions

__all__ = [
    "TRAINING_BACKENDS",
    "TrainingBackend",
    "make_strategy",
    "register_training_backend",
    "training_backend",
]


@runtime_checkable
class TrainingBackend(Protocol):
    """What a learner rank needs of a training backend (DeepSpeed ZeRO, torch FSDP2, ...).

    ``prepare`` returns an engine with the steps' ``TrainEngine`` shape: ``engine(...)`` runs the
    wrapped module's forward, ``backward(loss, scale_wrt_gas=False)`` and ``step()`` are called once per
    micro-batch (the window's last ``step`` applies the optimizer and the LR schedule),
    ``get_global_grad_norm()``, ``module``, ``device``, ``train()`` / ``eval()``.
    """

    name: str
    options: StrategyOptions
    reshards_checkpoints: bool
    """A checkpoint written on N ranks loads on M."""

    @classmethod
    def check_options(cls, options: StrategyOptions) -> None:
        """Raise a one-line ValueError naming the option this backend cannot run."""

    @classmethod
    def sharding_stage(cls, options: StrategyOptions, *, train: bool) -> int:
        """The ZeRO stage whose at-rest sharding this backend's states match under ``options`` (0: whole
        replicas; 1: optimizer states; 2: + gradients; 3: + parameters): what memory plans divide by."""

    @classmethod
    def gathers_in_forward(cls, options: StrategyOptions) -> bool:
        """Whether a forward gathers each module's parameters collectively (every rank must then run the
        same modules: a vision tower on one rank's micro-batch only would hang the others)."""

    @classmethod
    def describe(cls, options: StrategyOptions) -> str:
        """A few words for plans and logs, e.g. ``ZeRO-2`` or ``FSDP2 full shard``."""

    def setup_distributed(self, **kwargs: Any) -> tuple[int, int]:
        """Join the default process group (collective) and seed every rank alike."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def data_parallel_rank(self) -> int: ...

    @property
    def sequence_parallel_group(self) -> Any: ...

    def loader_config(self, *, train: bool = True) -> dict[str, Any] | None:
        """What the model loaders take as ``ds_config`` (ZeRO-3 builds models partitioned), or None
        when models are built whole and sharded by :meth:`prepare`."""

    def prepare(self, model: nn.Module, *, train: bool = True, optimizer: Any = None) -> Any:
        """Wrap ``model`` with its optimizer and LR scheduler (``train=False``: inference, eval mode)."""

    def gather(self, params: Sequence[nn.Parameter]) -> AbstractContextManager[Any]:
        """A context in which ``params`` are whole: it yields None when the parameters themselves then
        hold their full data (ZeRO-3), else a list of full tensors in ``params``' order (DTensors).
        Collective over the model's group. Applied bucket by bucket (weight sync, export)."""

    def full_state_dict(
        self, model: nn.Module, *, prefix_to_strip: str = "", rank0_only: bool = False
    ) -> dict[str, torch.Tensor]: ...

    def export_hf(self, model: nn.Module, directory: str | Path, **kwargs: Any) -> Path: ...

    def save_checkpoint(
        self, engine: Any, directory: str | Path, *, tag: str, client_state: dict | None = None
    ) -> Path:
        """Weights, optimizer, scheduler and every rank's RNG state under ``directory/tag`` (collective)."""

    def load_checkpoint(self, engine: Any, directory: str | Path, *, tag: str | None = None) -> dict:
        """Restore what :meth:`save_checkpoint` wrote; returns the caller's ``client_state``."""

    def offload_states(self, engine: Any) -> str:
        """Move the engine's states to host memory for colocated engines; returns what it did or why not."""

    def reload_states(self, engine: Any) -> str: ...

    def memory_stats(self) -> dict[str, float]:
        """This rank's memory in GiB: host RSS, and the accelerator's allocated / peak where there is one."""


B = TypeVar("B", bound=type)

TRAINING_BACKENDS: dict[str, type] = {}
"""Backend name -> its strategy class (filled as the backends' modules are imported)."""

PLUGIN_GROUP = "rlhf.training_backends"
"""Entry-point group of installed packages' training backends (each names a module that registers one)."""


def _load_plugins() -> list[str]:
    """Import every module the ``rlhf.training_backends`` entry points name (each registers its backend);
    one line for each that fails to import (the others still load)."""
    from importlib.metadata import entry_points

    failed = []
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            ep.load()
        except Exception as err:  # a broken plugin is named, not a traceback from deep inside
            failed.append(f"training backend plugin {ep.name} ({ep.value}) failed to load: {err}")
    return failed


def register_training_backend(name: str) -> Callable[[B], B]:
    """Class decorator: register a :class:`TrainingBackend` under ``name`` (a second one under the same
    name is refused)."""

    def add(cls: B) -> B:
        if name in TRAINING_BACKENDS and TRAINING_BACKENDS[name] is not cls:
            raise ValueError(f"training backend {name!r} is registered already ({TRAINING_BACKENDS[name]!r})")
        cls.name = name
        TRAINING_BACKENDS[name] = cls
        return cls

    return add


def training_backend(name: str) -> type:
    """The class registered as ``name`` (installed plugins loaded first when it is not registered yet); a
    one-line ValueError listing the known ones otherwise."""
    failed = _load_plugins() if name not in TRAINING_BACKENDS else []
    try:
        return TRAINING_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(TRAINING_BACKENDS))
        why = "".join(f"; {line}" for line in failed)
        raise ValueError(f"backend: expected one of {known}, got {name!r}{why}") from None


def make_strategy(options: StrategyOptions) -> Any:
    """The strategy of the backend ``options.backend`` names, built from ``options``."""
    return training_backend(options.backend)(options)
