"""Ready-made load callbacks for :meth:`WeightReceiver.receive`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

__all__ = ["copy_into"]


def copy_into(
    target: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    strict: bool = True,
    optional: Callable[[str], bool] | None = None,
) -> Callable[[Iterable[tuple[str, torch.Tensor]]], None]:
    """A load callback that copies each received tensor into ``target``'s tensor of the same name.

    ``target`` is a module (its ``state_dict(keep_vars=True)``: parameters and persistent buffers,
    tied names included) or a mapping of names to tensors. Copies cast to the target's dtype and
    device. With ``strict``, an unknown name or a shape mismatch raises ValueError naming the tensor,
    and so does a sync that leaves some of ``target``'s names unset. Tensors split across buckets
    are written piece by piece, each piece once verified, straight into the target tensor where it
    has the wire dtype and is contiguous (see :class:`_CopyInto`). ``optional(name)``: a target tensor a
    strict sync may leave unset (e.g. a frozen part the sender does not send).
    """
    tensors = dict(target.state_dict(keep_vars=True)) if isinstance(target, torch.nn.Module) else dict(target)
    return _CopyInto(tensors, strict=strict, optional=optional)


class _CopyInto:
    """The callback returned by :func:`copy_into`.

    Besides being called with the iterator, it offers ``target_for(name)``: the receiver then copies
    each verified piece of a tensor split across buckets straight into that tensor (when dtype,
    shape and device match and it is contiguous) and yields the target itself, which is not copied
    again. Without it such tensors are assembled in a scratch buffer first: one more copy of them.
    """

    def __init__(
        self, tensors: dict[str, torch.Tensor], *, strict: bool, optional: Callable[[str], bool] | None = None
    ) -> None:
        self.tensors, self.strict, self.optional = tensors, strict, optional

    def target_for(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors, seen = self.tensors, set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                dst = tensors.get(name)
                if dst is None:
                    if self.strict:
                        raise ValueError(f"received tensor {name!r} has no counterpart in the target")
                    continue
                if dst.shape != tensor.shape:
                    raise ValueError(
                        f"tensor {name!r}: received shape {tuple(tensor.shape)}, target {tuple(dst.shape)}"
                    )
                if tensor is not dst:  # not already written in place by the receiver
                    dst.copy_(tensor)
                seen.add(name)
        if self.strict and len(seen) < len(tensors):
            missing = sorted(n for n in set(tensors) - seen if self.optional is None or not self.optional(n))
            if missing:
                raise ValueError(
                    f"the sync did not contain {len(missing)} of the target's tensors, e.g. {missing[:3]}"
                )
