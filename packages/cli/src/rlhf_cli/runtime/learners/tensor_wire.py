"""Tensors through Ray (task arguments and results between the driver and the learner ranks) as NumPy
byte arrays, which pickle protocol 5 ships out of band, instead of torch's own pickling (a ``torch.save``
per tensor), which costs far more for the many small tensors of a step (docs/performance.md).

Ray applies a registered serializer to objects of exactly that type in the process that registered it
(:func:`register`: the driver once Ray is up, and each learner rank), so parameters and other tensor
subclasses keep torch's pickling. What arrives is a copy of its own (Ray hands every reader of an object the
same stored bytes).
"""

from __future__ import annotations

import io
from typing import Any

import torch

__all__ = ["from_wire", "register", "to_wire"]


def register() -> None:
    """Send this process's plain tensors through Ray as byte arrays (Ray must be initialised). Ray keeps
    it for the life of the process (past ``ray.shutdown``), in place of any serializer registered for
    ``torch.Tensor`` before (Ray's own zero-copy one, ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``)."""
    import ray

    ray.util.register_serializer(torch.Tensor, serializer=to_wire, deserializer=from_wire)


def to_wire(t: torch.Tensor) -> tuple[Any, ...]:
    """``("bytes", uint8 array, dtype, shape)`` for a dense CPU tensor without autograd state; anything
    else (on a device, requiring grad, sparse, quantized) as ``("saved", torch.save bytes)``."""
    plain = t.layout == torch.strided and not (t.requires_grad or t.is_quantized or t.is_nested)
    if t.device.type == "cpu" and plain:
        flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        return ("bytes", flat.view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))
    buf = io.BytesIO()
    torch.save(t, buf)
    return ("saved", buf.getvalue())


def from_wire(wire: tuple[Any, ...]) -> torch.Tensor:
    """The tensor :func:`to_wire` described, in memory of its own."""
    if wire[0] == "bytes":
        _, data, dtype, shape = wire
        if data.size == 0:  # (an empty array's stride does not allow the view)
            return torch.empty(shape, dtype=getattr(torch, dtype))
        return torch.from_numpy(data.copy()).view(getattr(torch, dtype)).reshape(shape)
    return torch.load(io.BytesIO(wire[1]), weights_only=False)
