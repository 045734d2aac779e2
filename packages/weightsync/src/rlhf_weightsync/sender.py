"""The sending side (rank 0 of a sync group): walk tensors, cast, pack into buckets, ship, await acks."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch

from rlhf_weightsync._endpoint import Endpoint, check_transport_name
from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.checksum import WORD, align, word_sum
from rlhf_weightsync.errors import WeightSyncError
from rlhf_weightsync.layout import (
    BucketLayout,
    Manifest,
    TensorSpec,
    check_bucket_bytes,
    collect,
    plan_buckets,
)
from rlhf_weightsync.protocol import TransportName
from rlhf_weightsync.stats import SyncStats

__all__ = ["DEFAULT_BUCKET_BYTES", "GatherFn", "WeightSender", "gather_along"]

DEFAULT_BUCKET_BYTES: dict[str, int] = {
    "gloo": 32 << 20,
    "shm": 4 << 20,
    "nccl": 64 << 20,
    "cuda_ipc": 64 << 20,
}
"""Per transport: shared-memory slots pipeline best with smaller buckets (measured, see the README);
broadcasts amortise their per-call cost over larger ones."""

GatherFn = Callable[[list[torch.Tensor]], AbstractContextManager]
"""``gather(params)`` returns a context manager inside which ``params`` hold their full data (it yields
None), e.g. ``lambda ps: deepspeed.zero.GatheredParameters(ps)`` for ZeRO-3; or which yields the full
tensors, in ``params``' order (FSDP2's sharded DTensors: ``[p.full_tensor() for p in ps]``). Applied once
per bucket."""


class WeightSender(Endpoint):
    """Rank 0 of a sync group: ships weights to ``world_size - 1`` receivers.

    Construction is collective: it hosts the group's TCPStore at ``master_addr:master_port``, waits
    (at most ``connect_timeout_s``, default ``timeout_s``) for every receiver to join, and connects
    the transport. ``timeout_s`` bounds every wait of a sync: a receiver that dies or stalls makes
    :meth:`send` raise :class:`~rlhf_weightsync.errors.WeightSyncError` naming it, instead of hanging.
    ``bucket_bytes`` (a multiple of 64, at least 4096; default per transport,
    :data:`DEFAULT_BUCKET_BYTES`) caps each bucket, checksum trailer included; the ``shm`` and
    ``cuda_ipc`` transports keep four (``shm``) or two (``cuda_ipc``) buckets' worth of shared memory
    mapped.
    ``device``: the CUDA device of the ``nccl`` / ``cuda_ipc`` buffers (default: the current one).
    ``listener``: a socket already listening on ``master_addr:master_port`` (held since the port was
    chosen, so that no other process could take it meanwhile), which the store then serves on; without
    it the sender binds ``master_port`` itself.
    """

    def __init__(
        self,
        *,
        transport: TransportName,
        master_addr: str,
        master_port: int,
        world_size: int,
        timeout_s: float = 60.0,
        connect_timeout_s: float | None = None,
        bucket_bytes: int | None = None,
        device: torch.device | str | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        check_transport_name(transport)
        bucket_bytes = DEFAULT_BUCKET_BYTES[transport] if bucket_bytes is None else bucket_bytes
        check_bucket_bytes(bucket_bytes)
        self.bucket_bytes = bucket_bytes
        rdv = Rendezvous(
            master_addr=master_addr,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            info={"transport": transport, "bucket_bytes": bucket_bytes},
            listener=listener,
        )
        self._open(transport, rdv, bucket_bytes=bucket_bytes, device=device)
        self._version = 0

    @property
    def version(self) -> int:
        """Version of the last sync that reached every receiver, failed or not (0 before the first)."""
        return self._version

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        dtype: torch.dtype | None = None,
        gather: GatherFn | None = None,
        version: int | None = None,
    ) -> SyncStats:
        """Ship one complete set of weights to every receiver and wait until all have loaded them.

        ``named_tensors``: ``(name, tensor)`` pairs, e.g. ``model.named_parameters()`` or a state
        dict's items; any device. Names tied to the same tensor (same storage and view) are shipped
        once and delivered under every name. Pass parameters, not detached copies, when ``gather``
        is used (ZeRO-3 shapes come from ``ds_shape`` before gathering, a shard's from its
        ``rlhf_full_shape``: :data:`~rlhf_weightsync.layout.FULL_SHAPE_ATTR`).
        ``dtype``: wire dtype of floating-point tensors (e.g. the engine's ``torch.bfloat16``);
        others keep their dtype. ``None`` keeps every dtype.
        ``gather``: applied to the tensors of each bucket while that bucket is packed.
        ``version``: weights version to announce, greater than the previous one; default previous + 1.
        """
        self._check_ready()
        _check_dtype(dtype)
        version = self._next_version(version)
        t0 = time.perf_counter()
        specs, sources = collect(named_tensors, dtype)
        if gather is None:
            _check_whole(specs, sources)
        buckets = plan_buckets(specs, self.bucket_bytes)
        manifest = Manifest(
            version=version, bucket_bytes=self.bucket_bytes, tensors=tuple(specs), buckets=buckets
        )
        sync = self._sync
        with self._sync_threads():
            self._ship(manifest, specs, sources, gather)
        failures = self._finish(version)
        if failures:
            raise WeightSyncError(f"sync {sync} (version {version}) failed on " + "; ".join(failures))
        return SyncStats(
            version=version,
            num_tensors=len(specs),
            num_names=sum(1 + len(s.aliases) for s in specs),
            num_buckets=len(buckets),
            num_bytes=manifest.payload_bytes,
            seconds=time.perf_counter() - t0,
        )

    def _check_ready(self) -> None:
        """Refuse to start a sync on a closed sender or one out of step with its receivers."""
        if self._closed:
            raise WeightSyncError("send() on a closed WeightSender")
        if self._broken:
            raise WeightSyncError(f"this sender is out of step with its receivers after: {self._broken}")

    def _next_version(self, version: int | None) -> int:
        """The version this sync announces: ``version``, checked to exceed the previous one, or previous + 1."""
        if version is None:
            return self._version + 1
        if not isinstance(version, int) or version <= self._version:
            raise ValueError(
                f"version: expected an int greater than the previous {self._version}, got {version!r}"
            )
        return version

    def _ship(
        self,
        manifest: Manifest,
        specs: list[TensorSpec],
        sources: list[torch.Tensor],
        gather: GatherFn | None,
    ) -> None:
        """Announce ``manifest``, pack and post every bucket, and wait until every receiver is done.

        Any failure leaves this sender out of step with its receivers: it is marked broken.
        """
        rdv, sync, version = self._rdv, self._sync, manifest.version
        rdv.set(f"sync/{sync}/manifest", manifest.to_bytes())
        try:
            self._transport.begin(sync, [b.nbytes for b in manifest.buckets])
            for index, bucket in enumerate(manifest.buckets):
                buf = self._transport.acquire(index)
                params = list({id(sources[p.tensor]): sources[p.tensor] for p in bucket.pieces}.values())
                with gather(params) if gather is not None else contextlib.nullcontext() as full:
                    _pack(buf, bucket, specs, _whole(sources, params, full))
                self._transport.post(index)
            self._transport.flush()
            rdv.wait_ranks(
                f"sync/{sync}/done",
                rdv.receivers,
                what=f"receivers to finish sync {sync} (version {version})",
            )
        except BaseException as exc:
            self._broken = f"sync {sync} (version {version}) failed: {type(exc).__name__}: {exc}"
            raise

    def _finish(self, version: int) -> list[str]:
        """Collect every receiver's status, clear this sync's keys and move on to the next sync;
        return one line per receiver that failed."""
        rdv, sync = self._rdv, self._sync
        failures = []
        for r in rdv.receivers:
            status = rdv.get(f"sync/{sync}/done/{r}").decode()
            if status != "ok":
                failures.append(f"rank {r}: {status}")
        rdv.delete([f"sync/{sync}/manifest", *(f"sync/{sync}/done/{r}" for r in rdv.receivers)])
        self._sync += 1
        self._version = version  # a failed sync may have been partly loaded: its version is used up
        return failures


def _whole(
    sources: list[torch.Tensor], params: list[torch.Tensor], full: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """``sources`` with each of ``params`` replaced by its full tensor where a gather yielded them."""
    if full is None:
        return sources
    if len(full) != len(params):
        raise ValueError(f"gather: yielded {len(full)} tensors for {len(params)} parameters")
    swap = {id(p): f for p, f in zip(params, full, strict=True)}
    return [swap.get(id(s), s) for s in sources]


def _check_dtype(dtype: torch.dtype | None) -> None:
    """``send``'s wire ``dtype`` must be a floating-point ``torch.dtype`` or ``None``."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype: expected a floating-point torch.dtype or None, got {dtype!r}")


def _check_whole(specs: list[TensorSpec], sources: list[torch.Tensor]) -> None:
    """Without a ``gather``, every source must already hold all of its elements."""
    for spec, src in zip(specs, sources, strict=True):
        if src.numel() != spec.numel:
            raise ValueError(
                f"tensor {spec.name!r}: holds {src.numel()} of its {spec.numel} elements "
                "(a ZeRO-3 partition?); pass gather=..."
            )


def gather_along(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    gather: GatherFn,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
) -> int:
    """On learner ranks other than the sender: enter the same per-bucket ``gather`` contexts, in the
    same order, as :meth:`WeightSender.send` does on the sender, without sending anything.

    ZeRO-3 gathers are collective over the learner's data-parallel group, so every learner rank must
    take part while rank 0 sends. Pass the same tensors (in the same order), ``dtype`` and the
    sender's ``bucket_bytes``: the bucket plan is a pure function of them. Returns the number of buckets.
    """
    specs, sources = collect(named_tensors, dtype)
    buckets = plan_buckets(specs, bucket_bytes)
    for bucket in buckets:
        with gather(list({id(sources[p.tensor]): sources[p.tensor] for p in bucket.pieces}.values())):
            pass
    return len(buckets)


def _pack(
    buf: torch.Tensor, bucket: BucketLayout, specs: list[TensorSpec], sources: list[torch.Tensor]
) -> None:
    """Copy (and cast) every piece into ``buf``, zero each piece's tail to a word, write the trailer."""
    sums = []
    for piece in bucket.pieces:
        spec, src = specs[piece.tensor], sources[piece.tensor]
        if src.numel() != spec.numel:
            raise ValueError(
                f"tensor {spec.name!r}: has {src.numel()} elements while packing but {spec.numel} were "
                f"planned (a ZeRO-3 parameter outside its gather? pass gather=...)"
            )
        nbytes = piece.count * spec.itemsize
        dst = buf[piece.offset : piece.offset + nbytes].view(spec.dtype)
        dst.copy_(src.detach().reshape(-1)[piece.start : piece.start + piece.count])
        tail = align(nbytes, WORD) - nbytes
        if tail:
            buf[piece.offset + nbytes : piece.offset + nbytes + tail].zero_()
        sums.append(word_sum(buf, piece.offset, nbytes))
    trailer = buf[bucket.trailer_offset : bucket.nbytes].view(torch.int64)
    trailer.copy_(torch.stack(sums))
