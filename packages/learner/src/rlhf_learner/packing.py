"""Sample packing: several sequences per row, no attention across them; token-balanced micro-batches.

A packed row carries per-sequence ``position_ids`` that restart at 0 for each sequence and no
``attention_mask``. transformers reads such rows as packed: its sdpa / eager mask builder derives a
block-diagonal causal mask from the position restarts (``find_packed_sequence_indices``), and its
flash-attention path turns them into varlen ``cu_seqlens`` on GPU. The model call is the same on both.
The tail of a row is padding with its own positions (one extra "sequence" that every mask excludes).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["PackedBatch", "balance_micro_batches", "for_kernel", "pack_sequences", "plan_rows", "unpack"]


@dataclass(frozen=True, kw_only=True)
class PackedBatch:
    """Packed rows plus where each original sequence went."""

    tensors: dict[str, torch.Tensor]
    """``[R, L]`` tensors: ``input_ids``, ``position_ids`` and every per-token field that was packed."""
    placement: list[tuple[int, int, int]]
    """For original sequence ``i``: ``(row, start, length)``."""


def for_kernel(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    attn_implementation: str | None,
    keep_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Packed ``[R, L]`` rows laid out for the attention kernel, and how to put the model's per-token
    outputs (``[R', L', ...]``) back as ``[R, L, ...]``.

    - flash-attention: rows end to end as one row. transformers reads position restarts as separate
      sequences (varlen) only when the batch is one row; each row starts a sequence at position 0, so
      no sequence crosses into the next row.
    - sdpa / eager build a block-diagonal mask and compute the whole masked square of each row: rows at
      least twice as wide as their longest sequence are re-packed into rows as wide as it (attention
      then costs about what padded rows would, with little padding).

    ``keep_order``: the tokens keep their order, row after row (rows with images, whose pixels come in the
    order of their tokens): sdpa / eager rows are taken as given (pack them no wider than needed)."""
    if "flash" in (attn_implementation or ""):
        return _one_row(input_ids, position_ids)
    if keep_order:
        return input_ids, position_ids, _same
    return _narrow_rows(input_ids, position_ids)


def _same(out: torch.Tensor) -> torch.Tensor:
    return out


def _one_row(input_ids: torch.Tensor, position_ids: torch.Tensor):
    rows, width = input_ids.shape
    if rows == 1 or bool((position_ids[:, 0] != 0).any()):  # one row, or rows not of whole sequences
        return input_ids, position_ids, _same
    back = lambda out: out.reshape(rows, width, *out.shape[2:])  # noqa: E731
    return input_ids.reshape(1, rows * width), position_ids.reshape(1, rows * width), back


def _narrow_rows(input_ids: torch.Tensor, position_ids: torch.Tensor):
    rows, width = input_ids.shape
    if bool((position_ids[:, 0] != 0).any()):  # not rows of whole sequences
        return input_ids, position_ids, _same
    # Every sequence as a span (row, start, length), the padding tail of a row included: a span starts
    # where the positions restart and ends where the next one starts (or at the row's end).
    span_row, span_start = (position_ids == 0).cpu().nonzero(as_tuple=True)
    last = torch.ones_like(span_row, dtype=torch.bool)
    last[:-1] = span_row[1:] != span_row[:-1]
    span_len = torch.where(last, width, span_start.roll(-1)) - span_start
    lengths = span_len.tolist()
    longest = max(lengths)
    if 2 * longest > width:
        return input_ids, position_ids, _same
    plan = plan_rows(lengths, max_tokens_per_row=longest)
    new_row, offset = [0] * len(lengths), [0] * len(lengths)
    for r, members in enumerate(plan):
        taken = 0
        for i in members:
            new_row[i], offset[i], taken = r, taken, taken + lengths[i]
    # One flat index per token: where it is in the given rows (src) and in the narrow ones (dst).
    span_of = torch.repeat_interleave(torch.arange(len(lengths)), span_len)
    within = torch.arange(len(span_of)) - (span_len.cumsum(0) - span_len)[span_of]
    src = ((span_row * width + span_start)[span_of] + within).to(input_ids.device)
    dst = ((torch.tensor(new_row) * longest + torch.tensor(offset))[span_of] + within).to(input_ids.device)
    ids = input_ids.new_zeros((len(plan), longest))
    pos = torch.arange(longest, device=position_ids.device).repeat(len(plan), 1)  # tails: own sequence
    ids.view(-1)[dst] = input_ids.reshape(-1)[src]
    pos.view(-1)[dst] = position_ids.reshape(-1)[src].to(pos.dtype)
    used = torch.zeros(len(plan) * longest, dtype=torch.bool, device=pos.device)
    used[dst] = True
    tail_start = used.view(len(plan), longest).sum(1, keepdim=True)  # each row's members, then its tail
    pos = torch.where(used.view(len(plan), longest), pos, pos - tail_start)

    def back(out: torch.Tensor) -> torch.Tensor:
        res = out.new_zeros((rows * width, *out.shape[2:]))
        res[src] = out.reshape(len(plan) * longest, *out.shape[2:])[dst]
        return res.view(rows, width, *out.shape[2:])

    return ids, pos, back


def plan_rows(lengths: Sequence[int], *, max_tokens_per_row: int) -> list[list[int]]:
    """First-fit-decreasing: group sequence indices into rows of at most ``max_tokens_per_row`` tokens."""
    if max_tokens_per_row < 1:
        raise ValueError(f"max_tokens_per_row must be positive, got {max_tokens_per_row}")
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens_per_row]
    if too_long:
        raise ValueError(
            f"sequence {too_long[0]} has {lengths[too_long[0]]} tokens, more than max_tokens_per_row={max_tokens_per_row}"
        )
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for r, space in enumerate(free):
            if lengths[i] <= space:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(max_tokens_per_row - lengths[i])
    return rows


def pack_sequences(
    sequences: Sequence[Mapping[str, torch.Tensor]],
    *,
    max_tokens_per_row: int,
    pad_values: Mapping[str, float | int] | None = None,
    pad_to_multiple: int = 1,
) -> PackedBatch:
    """Pack 1-D per-token tensors (each sequence a dict with ``input_ids`` and any other ``[T]`` fields,
    all the same length) into rows. Padding: ``pad_values[key]`` (default 0). Row width: the longest
    row, rounded up to ``pad_to_multiple``."""
    if not sequences:
        raise ValueError("sequences: nothing to pack")
    keys = list(sequences[0])
    if "input_ids" not in keys:
        raise ValueError("sequences: each needs 'input_ids'")
    lengths = []
    for i, s in enumerate(sequences):
        if list(s) != keys:
            raise ValueError(f"sequence {i}: fields {list(s)} differ from {keys}")
        n = s["input_ids"].shape[0]
        if n == 0:
            raise ValueError(f"sequence {i} is empty")
        if any(v.shape != (n,) for v in s.values()):
            raise ValueError(f"sequence {i}: every field must be 1-D of length {n}")
        lengths.append(n)
    rows = plan_rows(lengths, max_tokens_per_row=max_tokens_per_row)
    width = max(sum(lengths[i] for i in row) for row in rows)
    width = -(-width // pad_to_multiple) * pad_to_multiple
    pad_values = dict(pad_values or {})
    out = {k: torch.full((len(rows), width), pad_values.get(k, 0), dtype=sequences[0][k].dtype) for k in keys}
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    placement: list[tuple[int, int, int]] = [(0, 0, 0)] * len(sequences)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = lengths[i]
            for k in keys:
                out[k][r, start : start + n] = sequences[i][k]
            pos[r, start : start + n] = torch.arange(n)
            placement[i] = (r, start, n)
            start += n
        pos[r, start:] = torch.arange(width - start)
    out["position_ids"] = pos
    return PackedBatch(tensors=out, placement=placement)


def unpack(packed: torch.Tensor, placement: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
    """The per-sequence 1-D slices of a packed ``[R, L, ...]`` tensor, in the original order."""
    return [packed[r, s : s + n] for r, s, n in placement]


def balance_micro_batches(lengths: Sequence[int], num_micro_batches: int) -> list[list[int]]:
    """Split sequence indices into ``num_micro_batches`` groups with near-equal token totals
    (longest-processing-time greedy: each sequence, longest first, goes to the lightest group).
    Every group gets at least one sequence."""
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be positive, got {num_micro_batches}")
    if len(lengths) < num_micro_batches:
        raise ValueError(f"{len(lengths)} sequences cannot fill {num_micro_batches} micro-batches")
    heap = [(0, g) for g in range(num_micro_batches)]
    groups: list[list[int]] = [[] for _ in range(num_micro_batches)]
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + lengths[i], g))
    return [sorted(g) for g in groups]
