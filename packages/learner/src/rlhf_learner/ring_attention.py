"""Sequence parallelism with ring attention.

The sequence is split into contiguous chunks, one per rank of a sequence-parallel group (rank ``r``
holds tokens ``[r*C, (r+1)*C)``). Each rank keeps its queries; key/value chunks travel around the
ring, and each rank merges the partial attention of every chunk with an online softmax
(Liu et al., 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889):

``o = sum_j exp(lse_j - lse) o_j``, ``lse = log sum_j exp(lse_j)``.

Causality: the chunk of rank ``r`` attends to chunks ``j < r`` fully, to its own chunk causally,
and not at all to chunks ``j > r``. The backward pass sends key/value chunks around the ring again
with their gradient accumulators, which arrive back at their owner after a full turn.

On CPU this is pure torch over a gloo group (:func:`ring_attention`); on GPU with ring-flash-attn
installed, :func:`ring_flash_attention` calls its fused kernels. :func:`use_ring_attention` plugs
either into a transformers model as an attention implementation.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "RING_ATTENTION",
    "gather_sequence",
    "ring_attention",
    "ring_flash_attention",
    "split_sequence",
    "use_ring_attention",
]

RING_ATTENTION = "rlhf_ring_attention"
"""Name under which :func:`use_ring_attention` registers the attention function with transformers."""

_GROUP: dict[str, Any] = {"group": None}


def _ring_pass(tensors: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of ``group`` and receive the previous rank's."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:
        return tensors
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return recv


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """Attention of ``q`` over one key block: ``(out, lse)`` with ``lse`` ``[B, H, Lq]``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, group):  # type: ignore[override]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        qf, kc, vc = q.float(), k.float(), v.float()
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(size):
            src = (rank - step) % size
            if src <= rank:
                o_b, lse_b = _block(qf, kc, vc, scale, causal=src == rank)
                new = torch.logaddexp(lse, lse_b)
                out = out * torch.exp(lse - new)[..., None] + o_b * torch.exp(lse_b - new)[..., None]
                lse = new
            if step + 1 < size:
                kc, vc = _ring_pass([kc, vc], group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group = scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        qf, dout = q.float(), dout.float()
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        kc, vc = k.float(), v.float()
        dk, dv = torch.zeros_like(kc), torch.zeros_like(vc)
        for step in range(size):
            src = (rank - step) % size
            if src <= rank:
                s = torch.matmul(qf, kc.transpose(-1, -2)) * scale
                if src == rank:
                    lq, lk = s.shape[-2:]
                    s = s.masked_fill(
                        torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), float("-inf")
                    )
                p = torch.exp(s - lse[..., None])
                dv = dv + torch.matmul(p.transpose(-1, -2), dout)
                ds = p * (torch.matmul(dout, vc.transpose(-1, -2)) - delta)
                dq = dq + torch.matmul(ds, kc) * scale
                dk = dk + torch.matmul(ds.transpose(-1, -2), qf) * scale
            # Accumulators travel with their key/value chunk; after ``size`` passes they are home.
            kc, vc, dk, dv = _ring_pass([kc, vc, dk, dv], group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any = None, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of this rank's query chunk over the whole (ring-distributed) sequence.

    ``q``, ``k``, ``v``: ``[B, H, C, D]`` (key/value heads already repeated to ``H``), this rank's
    contiguous chunk. Returns ``[B, H, C, D]``, equal to the matching rows of single-rank causal
    attention over the concatenated sequence; differentiable.
    """
    group = group if group is not None else dist.group.WORLD
    if q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q/k/v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, scale, group)


def ring_flash_available() -> bool:
    """True when CUDA and the ring-flash-attn package are present."""
    return torch.cuda.is_available() and importlib.util.find_spec("ring_flash_attn") is not None


def ring_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any = None, scale: float | None = None
) -> torch.Tensor:
    """GPU path: ring-flash-attn's fused causal ring attention, same layout as :func:`ring_attention`."""
    if not ring_flash_available():
        raise RuntimeError("ring_flash_attention needs a CUDA device and the ring-flash-attn package")
    from ring_flash_attn import ring_flash_attn_func

    out = ring_flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, causal=True, group=group
    )
    return out.transpose(1, 2)


def _attention_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-function signature; returns ``([B, C, H, D], None)``."""
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    fn = ring_flash_attention if query.is_cuda and ring_flash_available() else ring_attention
    out = fn(query, key, value, group=_GROUP["group"], scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def use_ring_attention(model: Any, group: Any = None) -> None:
    """Make ``model`` (a transformers model) attend through the ring over ``group`` (default: world).

    Feed each rank its chunk of ``input_ids`` with *global* ``position_ids`` and no
    ``attention_mask`` (right padding only: causal attention keeps pad tokens at the end harmless).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTENTION, _attention_interface)
    _GROUP["group"] = group
    model.set_attn_implementation(RING_ATTENTION)


def split_sequence(x: torch.Tensor, *, group: Any = None, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (the length must divide by the group size)."""
    group = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"sequence length {x.shape[dim]} is not divisible by the {size} sequence-parallel ranks"
        )
    return x.chunk(size, dim=dim)[rank]


def gather_sequence(x: torch.Tensor, *, group: Any = None, dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` (differentiable: gradients flow back to each chunk)."""
    import torch.distributed.nn.functional as dist_fn

    group = group if group is not None else dist.group.WORLD
    return torch.cat(dist_fn.all_gather(x.contiguous(), group=group), dim=dim)
