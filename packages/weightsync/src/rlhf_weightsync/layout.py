"""Bucket layout: which bytes of which tensor go where, described by a manifest both sides share.

A sync ships a list of tensors (:class:`TensorSpec`) in fixed-capacity buckets. A bucket is a flat
byte buffer::

    [piece 0 | pad | piece 1 | pad | ... | piece k-1 | pad to 8 | checksum 0 ... checksum k-1]

Each piece is a contiguous range of one tensor's elements, in the wire dtype, starting at a
64-byte-aligned offset, so that the receiver can view it as a tensor of any dtype without a copy
(bf16, fp8 and integer tensors are packed through byte views, never through a float conversion).
The trailer holds one int64 :func:`~rlhf_weightsync.checksum.word_sum` per piece. A tensor that does
not fit in the space left in a bucket starts a new bucket; a tensor larger than a whole bucket is
split into pieces across consecutive buckets. The planner needs only names, dtypes and shapes, so the
manifest is sent before any data, and a receiver knows every bucket's size before it arrives.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from rlhf_weightsync.checksum import WORD, align

__all__ = [
    "ALIGN",
    "MIN_BUCKET_BYTES",
    "BucketLayout",
    "Manifest",
    "Piece",
    "TensorSpec",
    "dtype_from_name",
    "plan_buckets",
]

ALIGN = 64
"""Byte alignment of every piece inside a bucket."""
MIN_BUCKET_BYTES = 4096
FORMAT = 1


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``torch.bfloat16``; ValueError naming unknown names."""
    attr = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(attr, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return attr


@functools.cache
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    """One tensor as it travels: its name, wire dtype and shape, and the names tied to it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()
    """Other names of the same storage (tied weights); shipped once, delivered under every name."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + count)`` of tensor number ``tensor`` (flat order), at byte ``offset``."""

    tensor: int
    start: int
    count: int
    offset: int


@dataclass(frozen=True, kw_only=True)
class BucketLayout:
    pieces: tuple[Piece, ...]
    nbytes: int
    """Bytes on the wire: pieces, padding and the checksum trailer."""

    @property
    def trailer_offset(self) -> int:
        return self.nbytes - WORD * len(self.pieces)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything a receiver needs to unpack one sync, sent before the first bucket."""

    version: int
    bucket_bytes: int
    tensors: tuple[TensorSpec, ...]
    buckets: tuple[BucketLayout, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "version": self.version,
            "bucket_bytes": self.bucket_bytes,
            "tensors": [[t.name, _dtype_name(t.dtype), list(t.shape), list(t.aliases)] for t in self.tensors],
            "buckets": [
                [b.nbytes, [[p.tensor, p.start, p.count, p.offset] for p in b.pieces]] for b in self.buckets
            ],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            raise ValueError(f"manifest format {doc.get('format')!r} is not {FORMAT} (mismatched versions?)")
        tensors = tuple(
            TensorSpec(name=n, dtype=dtype_from_name(d), shape=tuple(s), aliases=tuple(a))
            for n, d, s, a in doc["tensors"]
        )
        buckets = tuple(
            BucketLayout(nbytes=nb, pieces=tuple(Piece(*p) for p in pieces)) for nb, pieces in doc["buckets"]
        )
        return cls(version=doc["version"], bucket_bytes=doc["bucket_bytes"], tensors=tensors, buckets=buckets)


def check_bucket_bytes(bucket_bytes: int) -> None:
    if not isinstance(bucket_bytes, int) or bucket_bytes < MIN_BUCKET_BYTES or bucket_bytes % ALIGN:
        raise ValueError(
            f"bucket_bytes: expected an int >= {MIN_BUCKET_BYTES} and a multiple of {ALIGN}, got {bucket_bytes!r}"
        )


def plan_buckets(tensors: Sequence[TensorSpec], bucket_bytes: int) -> tuple[BucketLayout, ...]:
    """Greedy, order-preserving layout of ``tensors`` into buckets of at most ``bucket_bytes`` bytes.

    A tensor goes into the current bucket if it fits; otherwise, if it fits in an empty bucket, the
    current bucket is closed and it starts the next one; otherwise (it is larger than a bucket) it
    fills the current bucket and continues in as many further buckets as it needs.
    """
    check_bucket_bytes(bucket_bytes)
    buckets: list[BucketLayout] = []
    pieces: list[Piece] = []
    end = 0  # end of the last piece's bytes in the current bucket

    def close() -> None:
        nonlocal pieces, end
        if pieces:
            buckets.append(BucketLayout(pieces=tuple(pieces), nbytes=align(end, WORD) + WORD * len(pieces)))
        pieces, end = [], 0

    for index, spec in enumerate(tensors):
        itemsize, total = spec.itemsize, spec.numel
        start = 0
        while True:
            offset = align(end, ALIGN)
            avail = bucket_bytes - WORD * (len(pieces) + 1) - offset
            remaining = (total - start) * itemsize
            if remaining <= avail:
                pieces.append(Piece(index, start, total - start, offset))
                end = offset + remaining
                break
            if pieces and start == 0 and remaining <= bucket_bytes - WORD:
                close()
                continue
            count = max(avail, 0) // itemsize
            if count == 0:
                close()
                continue
            pieces.append(Piece(index, start, count, offset))
            end = offset + count * itemsize
            start += count
            close()
    close()
    return tuple(buckets)


def alias_key(tensor: torch.Tensor) -> object:
    """Two tensors with equal keys are the same storage seen through the same view (tied weights).

    Empty tensors (e.g. ZeRO-3 partitions before gathering) and tensors without storage of their own
    (FSDP2's sharded DTensors) are keyed by identity, so only the very same parameter object counts as tied.
    """
    if tensor.numel() == 0 or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return ("id", id(tensor))
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


FULL_SHAPE_ATTR = "rlhf_full_shape"
"""Attribute a shard's owner may set on a tensor (e.g. a tensor-parallel shard) to give the whole tensor's
shape, which its ``gather`` produces."""


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The tensor's logical shape, as a sender's ``gather`` makes it whole: :data:`FULL_SHAPE_ATTR` when
    set, DeepSpeed ZeRO-3's ``ds_shape``, else its own shape."""
    return tuple(getattr(tensor, FULL_SHAPE_ATTR, None) or getattr(tensor, "ds_shape", tensor.shape))


def collect(
    named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None
) -> tuple[list[TensorSpec], list[torch.Tensor]]:
    """Specs (with tied names folded into aliases) and the source tensor of each spec.

    ``dtype`` is the wire dtype of floating-point tensors; other tensors keep theirs.
    """
    names: set[str] = set()
    index_of: dict[object, int] = {}
    specs: list[dict] = []
    sources: list[torch.Tensor] = []
    for item in named_tensors:
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"expected (name, tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__})"
            )
        if name in names:
            raise ValueError(f"tensor name {name!r} appears twice")
        names.add(name)
        key = alias_key(tensor)
        if key in index_of:
            specs[index_of[key]]["aliases"].append(name)
            continue
        index_of[key] = len(specs)
        wire = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        specs.append({"name": name, "dtype": wire, "shape": full_shape(tensor), "aliases": []})
        sources.append(tensor)
    out = [
        TensorSpec(name=s["name"], dtype=s["dtype"], shape=s["shape"], aliases=tuple(s["aliases"]))
        for s in specs
    ]
    return out, sources
