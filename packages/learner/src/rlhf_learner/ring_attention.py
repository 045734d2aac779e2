"""Sequence parallelism with ring attention.

The sequence is split into contiguous chunks, one per rank of a sequence-parallel group (rank ``r``
holds tokens ``[r*C, (r+1)*C)``). Each rank keeps its queries; key/value chunks travel around the
ring, and each rank merges the partial attention of every chunk with an online softmax
(Liu et al., 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889):

``o = sum_j exp(lse_j - lse) o_j``, ``lse = log sum_j exp(lse_j)``.

Causality: the chunk of rank ``r`` attends to chunks ``j < r`` fully, to its own chunk causally,
and not at all to chunks ``j > r``. Packed rows (several sequences per row, ``position_ids``
restarting at 0) add one rule: a token attends only to tokens of its own sequence. A token's
sequence is identified by where it starts, ``global index - position id``, which every rank computes
for its chunk without communication; these ids travel with the key/value chunks. The backward pass
sends key/value chunks around the ring again with their gradient accumulators, which arrive back at
their owner after a full turn.

On CPU this is pure torch over a gloo group (:func:`ring_attention`); on GPU in 16-bit with
ring-flash-attn installed, its fused kernels: :func:`ring_flash_attention` for padded rows, and
:func:`ring_flash_varlen_attention` (its variable-length kernels) for packed rows.
:func:`use_ring_attention` plugs them into a transformers model as an attention implementation.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "PACKED_ROWS",
    "RING_ATTENTION",
    "gather_sequence",
    "ring_attention",
    "ring_flash_attention",
    "ring_flash_varlen_attention",
    "sequence_bounds",
    "sequence_starts",
    "split_sequence",
    "use_ring_attention",
]

RING_ATTENTION = "rlhf_ring_attention"
"""Name under which :func:`use_ring_attention` registers the attention function with transformers."""

PACKED_ROWS = "rlhf_packed_rows"
"""Keyword argument to pass (``True``) to a ring-attention model's forward for packed rows: transformers
hands it to the attention function, also when gradient checkpointing recomputes a layer."""

_GROUP_ATTR = "_rlhf_ring_group"
"""Attribute :func:`use_ring_attention` sets on every submodule of the model (a :class:`_GroupRef`): the
process group travels with the model (each attention layer reads its own), so two models can ring over
different groups."""


class _GroupRef:
    """Holds a process group for a model's modules. A deep copy of the model shares it (a group cannot
    be copied); a pickled model drops it (a group cannot cross processes: call use_ring_attention again)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> _GroupRef:
        return self

    def __reduce__(self):
        return (_GroupRef, (None,))


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


def sequence_starts(position_ids: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """``[B, C]`` global index of the first token of each token's sequence, for this rank's chunk of
    ``position_ids`` (``[B, C]``; chunk ``r`` holds global indices ``[r*C, (r+1)*C)``). Tokens of one
    sequence share the value, so equal values mean "same sequence"; for unpacked rows it is 0 throughout."""
    group = group if group is not None else dist.group.WORLD
    c = position_ids.shape[-1]
    index = dist.get_rank(group) * c + torch.arange(c, device=position_ids.device)
    return index - position_ids.long()


def _mask(lq: int, lk: int, causal: bool, seg_q, seg_k, device) -> torch.Tensor | None:
    """``True`` where attention is not allowed: later tokens of the same chunk, other sequences."""
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device).triu(1) if causal else None
    if seg_q is not None:
        other = (seg_q[:, :, None] != seg_k[:, None, :])[:, None]  # [B, 1, Lq, Lk]
        mask = other if mask is None else other | mask
    return mask


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, seg_q, seg_k):
    """Attention of ``q`` over one key block: ``(out, lse)`` with ``lse`` ``[B, H, Lq]``; rows with
    no allowed key get ``out = 0`` and ``lse = -inf``."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = _mask(s.shape[-2], s.shape[-1], causal, seg_q, seg_k, s.device)
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    finite = lse.masked_fill(lse == float("-inf"), 0.0)
    return torch.matmul(torch.exp(s - finite[..., None]), v), lse


def _merge(out, lse, o_b, lse_b):
    """Online-softmax merge of two partial results; a side with ``lse = -inf`` contributes nothing."""
    new = torch.logaddexp(lse, lse_b)
    finite = new.masked_fill(new == float("-inf"), 0.0)
    return out * torch.exp(lse - finite)[..., None] + o_b * torch.exp(lse_b - finite)[..., None], new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seg, scale, group):  # type: ignore[override]
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        qf, kc, vc, seg_k = q.float(), k.float(), v.float(), seg
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(size):
            src = (rank - step) % size
            if src <= rank:
                o_b, lse_b = _block(qf, kc, vc, scale, src == rank, seg, seg_k)
                out, lse = _merge(out, lse, o_b, lse_b)
            if step + 1 < size and seg is None:
                kc, vc = _ring_pass([kc, vc], group)
            elif step + 1 < size:
                kc, vc, seg_k = _ring_pass([kc, vc, seg_k], group)
        ctx.save_for_backward(q, k, v, seg, out, lse)
        ctx.scale, ctx.group = scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, seg, out, lse = ctx.saved_tensors
        scale, group = ctx.scale, ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        qf, dout = q.float(), dout.float()
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        kc, vc, seg_k = k.float(), v.float(), seg
        dk, dv = torch.zeros_like(kc), torch.zeros_like(vc)
        for step in range(size):
            src = (rank - step) % size
            if src <= rank:
                s = torch.matmul(qf, kc.transpose(-1, -2)) * scale
                mask = _mask(s.shape[-2], s.shape[-1], src == rank, seg, seg_k, s.device)
                if mask is not None:
                    s = s.masked_fill(mask, float("-inf"))
                p = torch.exp(s - lse[..., None])  # every query attends to itself: lse is finite
                dv = dv + torch.matmul(p.transpose(-1, -2), dout)
                ds = p * (torch.matmul(dout, vc.transpose(-1, -2)) - delta)
                dq = dq + torch.matmul(ds, kc) * scale
                dk = dk + torch.matmul(ds.transpose(-1, -2), qf) * scale
            # Accumulators travel with their key/value chunk; after ``size`` passes they are home.
            if seg is not None:
                kc, vc, dk, dv, seg_k = _ring_pass([kc, vc, dk, dv, seg_k], group)
            else:
                kc, vc, dk, dv = _ring_pass([kc, vc, dk, dv], group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    scale: float | None = None,
    sequence_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's query chunk over the whole (ring-distributed) sequence.

    ``q``, ``k``, ``v``: ``[B, H, C, D]`` (key/value heads already repeated to ``H``), this rank's
    contiguous chunk. ``sequence_ids`` (``[B, C]``, e.g. :func:`sequence_starts` of packed
    ``position_ids``): tokens attend only to tokens with the same id. Returns ``[B, H, C, D]``, equal
    to the matching rows of single-rank causal (block-diagonal causal, for packed rows) attention
    over the concatenated sequence; differentiable.
    """
    group = group if group is not None else dist.group.WORLD
    if q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q/k/v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if sequence_ids is not None and tuple(sequence_ids.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"sequence_ids: expected shape {(q.shape[0], q.shape[2])} (batch, chunk), got {tuple(sequence_ids.shape)}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seg = None if sequence_ids is None else sequence_ids.long().contiguous()
    return _RingAttention.apply(q, k, v, seg, scale, group)


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


def sequence_bounds(position_ids: torch.Tensor) -> torch.Tensor:
    """``[S + 1]`` int32 offsets of the sequences of one packed row of ``position_ids`` (``[L]``, each
    sequence restarting at position 0): ``cu_seqlens`` as flash-attn's variable-length kernels take them.
    A row that does not start a sequence at column 0 gets one there."""
    starts = (position_ids == 0).nonzero().flatten()
    edges = torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), position_ids.shape[0])])
    return torch.unique(edges).to(torch.int32)


def ring_flash_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    group: Any = None,
    scale: float | None = None,
) -> torch.Tensor:
    """GPU path for packed rows: ring-flash-attn's variable-length kernels (the "llama3" context-parallel
    scheme, for contiguous chunks: each rank gathers the keys and values its chunk's sequences reach and
    attends causally within each sequence). ``q``: ``[B, H, C, D]``, ``k`` / ``v``: ``[B, H_kv, C, D]``
    (grouped-query heads are not repeated), ``position_ids``: this rank's ``[B, C]`` chunk of the packed
    positions. Returns ``[B, H, C, D]``, equal to :func:`ring_attention` with :func:`sequence_starts`."""
    if not ring_flash_available():
        raise RuntimeError("ring_flash_varlen_attention needs a CUDA device and the ring-flash-attn package")
    from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func

    group = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    parts = [torch.empty_like(position_ids) for _ in range(size)]
    dist.all_gather(parts, position_ids.contiguous(), group=group)
    rows = torch.cat(parts, dim=1)  # the whole packed rows' positions (a few ints a token)
    outs = []
    for b in range(q.shape[0]):
        cu = sequence_bounds(rows[b]).to(q.device)
        cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(cu, True, rank, size)
        out = llama3_flash_attn_varlen_func(
            q[b].transpose(0, 1),  # [C, H, D]
            k[b].transpose(0, 1),
            v[b].transpose(0, 1),
            cu_q,
            cu_k,
            max_q,
            max_k,
            k.shape[1],  # every key/value head in one pass
            k_slice,
            softmax_scale=scale,
            causal=True,
            group=group,
        )
        outs.append(out.transpose(0, 1))
    return torch.stack(outs)


def _fused(query: torch.Tensor) -> bool:
    """ring-flash-attn's kernels serve this query: on CUDA, in 16-bit, with the package installed."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and ring_flash_available()


def _attention_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-function signature; returns ``([B, C, H, D], None)``."""
    ref = getattr(module, _GROUP_ATTR, None)
    group = ref.group if ref is not None else None
    packed = kwargs.get(PACKED_ROWS, False)
    position_ids = kwargs.get("position_ids")
    if packed and position_ids is None:
        raise ValueError("ring attention over packed rows needs the position_ids of this rank's chunk")
    if packed and _fused(query):
        out = ring_flash_varlen_attention(query, key, value, position_ids, group=group, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    if packed:
        seg = sequence_starts(position_ids, group=group)
        out = ring_attention(query, key, value, group=group, scale=scaling, sequence_ids=seg)
    else:
        fn = ring_flash_attention if _fused(query) else ring_attention
        out = fn(query, key, value, group=group, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def use_ring_attention(model: Any, group: Any = None) -> None:
    """Make ``model`` (a transformers model) attend through the ring over ``group`` (default: world).

    Feed each rank its chunk of ``input_ids`` with *global* ``position_ids`` and no
    ``attention_mask`` (right padding only: causal attention keeps pad tokens at the end harmless);
    for packed rows, the chunk of the packed ``position_ids`` and ``rlhf_packed_rows=True``
    (:data:`PACKED_ROWS`). On GPU in 16-bit, ring-flash-attn's kernels serve both (fp32, and CPU, take
    the pure-torch ring, whose ``[B, H, C, C]`` fp32 score blocks grow with the square of the chunk).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTENTION, _attention_interface)  # a name for a stateless function
    ref = _GroupRef(group)
    for m in model.modules():
        setattr(m, _GROUP_ATTR, ref)
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


class _GatherSequence(torch.autograd.Function):
    """All-gather of equal chunks whose backward sums the gradients over the group (all-reduce) and
    keeps this rank's chunk. torch's own differentiable all-gather falls back, on gloo, to scatters
    addressed by group rank as if it were a global rank, which fails for any group but the first."""

    @staticmethod
    def forward(ctx, x, dim, group):  # type: ignore[override]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        ctx.dim, ctx.group = dim, group
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, *, group: Any = None, dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim`` (differentiable: each chunk gets the sum over the
    group of the gradients of its part of the result)."""
    group = group if group is not None else dist.group.WORLD
    return _GatherSequence.apply(x.contiguous(), dim, group)
