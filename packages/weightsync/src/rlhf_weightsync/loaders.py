"""Ready-made load callbacks for :meth:`WeightReceiver.receive`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

__all__ = ["copy_into"]


def copy_into(
    target: torch.nn.Module | Mapping[str, torch.Tensor], *, strict: bool = True
) -> Callable[[Iterable[tuple[str, torch.Tensor]]], None]:
    """A load callback that copies each received tensor into ``target``'s tensor of the same name.

    ``target`` is a module (its ``state_dict(keep_vars=True)``: parameters and persistent buffers,
    tied names included) or a mapping of names to tensors. Copies cast to the target's dtype and
    device. With ``strict``, an unknown name or a shape mismatch raises ValueError naming the tensor,
    and so does a sync that leaves some of ``target``'s names unset.
    """
    tensors = dict(target.state_dict(keep_vars=True)) if isinstance(target, torch.nn.Module) else dict(target)

    def load(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                dst = tensors.get(name)
                if dst is None:
                    if strict:
                        raise ValueError(f"received tensor {name!r} has no counterpart in the target")
                    continue
                if dst.shape != tensor.shape:
                    raise ValueError(
                        f"tensor {name!r}: received shape {tuple(tensor.shape)}, target {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
                seen.add(name)
        if strict and len(seen) < len(tensors):
            missing = sorted(set(tensors) - seen)
            raise ValueError(
                f"the sync did not contain {len(missing)} of the target's tensors, e.g. {missing[:3]}"
            )

    return load
