"""One optimizer step over a gradient-accumulation window, with global loss normalisation."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from rlhf_learner.steps.batches import ModelRows

__all__ = [
    "NonFiniteLossError",
    "StepResult",
    "TrainEngine",
    "WindowCounts",
    "all_gather_rows",
    "loss_tensor",
    "masked_counts",
    "run_window",
]

Batch = TypeVar("Batch", bound=ModelRows)


class TrainEngine(Protocol):
    """What the steps need of a training engine, as a training backend's ``prepare`` returns it (a
    DeepSpeed engine, an ``FSDP2Engine``): ``backward`` and ``step`` once per micro-batch, the window's last
    ``step`` applying the optimizer. ``data_parallel_group``, ``get_global_grad_norm()`` and
    ``reports_grad_norm`` are read when present."""

    device: torch.device

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def gradient_accumulation_steps(self) -> int: ...

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> Any: ...

    def step(self) -> Any: ...


class NonFiniteLossError(FloatingPointError):
    """A micro-batch's loss was NaN or infinite on some data-parallel rank: raised on every rank before
    that micro-batch's backward, so the optimizer step that would apply it is never taken."""


@dataclass(frozen=True, kw_only=True)
class WindowCounts:
    """What a loss is normalised by: counts over the whole step (all micro-batches, all DP ranks)."""

    global_tokens: float
    """Masked tokens in the step."""
    global_seqs: float
    """Sequences (rows, pairs or examples, as the step defines them) in the step."""
    dp_size: int
    """Data-parallel ranks whose gradients are averaged."""


@dataclass(kw_only=True)
class StepResult:
    """What one update step reports (plain floats, global over the step)."""

    loss: float
    """The loss of the whole step (sum of micro-batch losses over ranks, divided by dp_size)."""
    grad_norm: float | None
    """Global gradient norm before clipping: DeepSpeed's, or measured by the step where DeepSpeed keeps none
    (ZeRO stage 0 in fp32); None with model parallelism there."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Step-specific means over the step (e.g. clip fraction, KL, accuracy)."""


def loss_tensor(out: Any) -> torch.Tensor:
    """A loss function's result as a tensor: the tensor itself or its ``.loss`` field (a NamedTuple
    such as rlhf-algos' ``PolicyLossOutput`` / ``DPOLossOutput``)."""
    return out.loss if hasattr(out, "loss") and not isinstance(out, torch.Tensor) else out


def _dp_group(engine: TrainEngine) -> Any:
    group = getattr(engine, "data_parallel_group", None)
    return group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)


def all_gather_rows(x: torch.Tensor, engine: TrainEngine) -> torch.Tensor:
    """``x`` (``[n, ...]``, ``n`` may differ per rank) concatenated over the engine's data-parallel
    ranks in rank order; ``x`` itself without a process group. Detached (no gradient flows back)."""
    group = _dp_group(engine)
    x = x.detach()
    if _alone(group):
        return x
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], dtype=torch.long, device=x.device), group=group)
    counts = [int(n) for n in sizes]
    padded = torch.zeros((max(counts), *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])


def _alone(group: Any) -> bool:
    """No other rank to reduce with (a collective over one rank still costs a gloo round trip)."""
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def _all_reduce_sum(values: list[float], group: Any, device: torch.device) -> list[float]:
    if _alone(group):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def _all_reduce_max(values: list[float], group: Any, device: torch.device) -> list[float]:
    if not values or _alone(group):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def masked_counts(mask: torch.Tensor) -> tuple[float, float]:
    """``count`` of :func:`run_window` for a ``[B, T]`` mask: masked tokens, and rows with at least one."""
    m = mask.bool()
    return float(m.sum()), float(m.any(-1).sum())


def run_window(
    engine: TrainEngine,
    micro_batches: Sequence[Batch],
    *,
    batch_type: type[Batch],
    count: Callable[[Batch], tuple[float, float]],
    compute: Callable[[Batch, WindowCounts], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    token_metrics: tuple[str, ...] = (),
) -> StepResult:
    """Run forward/backward on each micro-batch and one optimizer step.

    Each micro-batch must be a ``batch_type`` (the step's typed batch); it is moved to the engine's
    device first.
    ``count(mb) -> (tokens, seqs)`` is summed over the window and all-reduced over the DP group
    once; ``compute(mb, counts) -> (loss, metrics)`` must return a loss already normalised by those
    global counts (so summing micro-batch gradients and averaging over ranks gives the gradient of the
    whole step's loss). DeepSpeed's own ``1/gradient_accumulation_steps`` scaling is therefore off.
    ``metrics`` values are per-micro-batch sums (tensors) that are summed over the window and ranks and
    divided by the global token count (names in ``token_metrics``) or sequence count (the others);
    names ending in ``_max`` are maxima instead (over the window and ranks, not divided).
    """
    _check_micro_batches(engine, micro_batches, batch_type)
    group = _dp_group(engine)
    dp_size = dist.get_world_size(group) if dist.is_initialized() else 1
    device = engine.device
    micro_batches = [mb.to(device) for mb in micro_batches]
    counts = _window_counts(micro_batches, count, group, device, dp_size)
    total = torch.zeros((), dtype=torch.float64, device=device)
    sums: dict[str, torch.Tensor] = {}
    maxes: dict[str, float] = {}
    own_norm: float | None = None
    for i, mb in enumerate(micro_batches):
        loss, metrics = compute(mb, counts)
        _check_finite(loss, i, len(micro_batches), group, device)
        engine.backward(loss, scale_wrt_gas=False)
        if i == len(micro_batches) - 1 and not _reports_grad_norm(engine):
            own_norm = _local_grad_norm(engine)  # the boundary's gradients, before the step clips them
        engine.step()
        total += loss.detach().double()
        for k, v in metrics.items():
            if k.endswith("_max"):
                maxes[k] = max(maxes.get(k, -math.inf), float(v.detach().max()))
            else:
                sums[k] = sums.get(k, 0.0) + v.detach().double().sum()
    keys = sorted(sums)
    reduced = _all_reduce_sum([float(total)] + [float(sums[k]) for k in keys], group, device)
    out = {
        k: v / max(counts.global_tokens if k in token_metrics else counts.global_seqs, 1.0)
        for k, v in zip(keys, reduced[1:], strict=True)
    }
    out |= dict(
        zip(sorted(maxes), _all_reduce_max([maxes[k] for k in sorted(maxes)], group, device), strict=True)
    )
    norm = _grad_norm(engine)
    return StepResult(loss=reduced[0] / dp_size, grad_norm=own_norm if norm is None else norm, metrics=out)


def _check_finite(loss: torch.Tensor, i: int, n: int, group: Any, device: torch.device) -> None:
    """Raise :class:`NonFiniteLossError` on every rank when micro-batch ``i``'s loss is not finite on any
    (one flag all-reduced, so no rank goes on alone into a collective that would then hang)."""
    value = float(loss.detach())
    bad = _all_reduce_max([0.0 if math.isfinite(value) else 1.0], group, device)[0]
    if bad:
        where = f"loss {value}" if not math.isfinite(value) else "the loss on another data-parallel rank"
        raise NonFiniteLossError(
            f"micro-batch {i + 1} of {n}: {where} is not finite; the optimizer step was not taken"
        )


def _check_micro_batches(engine: TrainEngine, micro_batches: Sequence[Any], batch_type: type) -> None:
    """Raise unless there is one ``batch_type`` micro-batch per gradient-accumulation step."""
    gas = engine.gradient_accumulation_steps()
    if len(micro_batches) != gas:
        raise ValueError(
            f"micro_batches: got {len(micro_batches)}, the engine steps every {gas} (grad_accum_steps)"
        )
    for i, mb in enumerate(micro_batches):
        if not isinstance(mb, batch_type):
            raise TypeError(
                f"micro_batches[{i}]: got {type(mb).__name__}, this step takes {batch_type.__name__}"
            )


def _window_counts(
    micro_batches: Sequence[Batch],
    count: Callable[[Batch], tuple[float, float]],
    group: Any,
    device: torch.device,
    dp_size: int,
) -> WindowCounts:
    """``count`` summed over the window's micro-batches and all-reduced over the DP ``group``."""
    tokens, seqs = 0.0, 0.0
    for mb in micro_batches:
        t, s = count(mb)
        tokens, seqs = tokens + float(t), seqs + float(s)
    g_tokens, g_seqs = _all_reduce_sum([tokens, seqs], group, device)
    return WindowCounts(global_tokens=g_tokens, global_seqs=g_seqs, dp_size=dp_size)


def _reports_grad_norm(engine: TrainEngine) -> bool:
    """Whether DeepSpeed measures the gradient norm itself: its ZeRO and bf16 optimizers do; ZeRO stage 0 in
    fp32 (a plain torch optimizer) clips without keeping the norm. Engines without an ``optimizer``
    attribute are taken at their word (``get_global_grad_norm``)."""
    if getattr(engine, "reports_grad_norm", False):
        return True
    optimizer = getattr(engine, "optimizer", None)
    return optimizer is None or hasattr(optimizer, "_global_grad_norm")


def _local_grad_norm(engine: TrainEngine) -> float | None:
    """The L2 norm of the module's gradients after the window's last backward, for an engine that keeps
    none. Data-parallel ranks hold the same averaged gradients then; with model parallelism (``mpu``) each
    holds a part, so None."""
    module = getattr(engine, "module", None)
    if module is None or getattr(engine, "mpu", None) is not None:
        return None
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def _grad_norm(engine: TrainEngine) -> float | None:
    """The engine's global gradient norm as a float, or None when it reports none."""
    norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
    return float(norm) if norm is not None else None
