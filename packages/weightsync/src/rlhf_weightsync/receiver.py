"""The receiving side: unpack buckets, verify checksums, hand ``(name, tensor)`` pairs to a load callback."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch

from rlhf_weightsync._endpoint import Endpoint, check_transport_name
from rlhf_weightsync._rendezvous import Rendezvous
from rlhf_weightsync.checksum import word_sum
from rlhf_weightsync.errors import ChecksumError, WeightSyncError
from rlhf_weightsync.layout import Manifest, TensorSpec
from rlhf_weightsync.protocol import Transport, TransportName
from rlhf_weightsync.stats import SyncStats

__all__ = ["LoadFn", "WeightReceiver"]

LoadFn = Callable[[Iterable[tuple[str, torch.Tensor]]], object]
"""Called once per sync with an iterator over ``(name, tensor)``; must consume it to the end."""


class WeightReceiver(Endpoint):
    """Rank ``rank`` (>= 1) of a sync group: receives what the sender (rank 0) ships.

    Construction is collective (see :class:`~rlhf_weightsync.sender.WeightSender`); the transport
    name must match the sender's, and the bucket size is the sender's. ``timeout_s`` bounds every
    wait inside a sync; :meth:`receive` takes its own timeout for the wait until a sync starts.
    """

    def __init__(
        self,
        *,
        transport: TransportName,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 60.0,
        connect_timeout_s: float | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_transport_name(transport)
        if rank == 0:
            raise ValueError("rank: 0 is the sender's rank; receivers use 1 .. world_size - 1")
        rdv = Rendezvous(
            master_addr=master_addr,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            info={"transport": transport},
        )
        self._open(transport, rdv, bucket_bytes=rdv.sender_info["bucket_bytes"], device=device)
        # Where tensors split across buckets are assembled; kept between syncs on CPU (a fresh
        # allocation per sync would page-fault through the largest tensors every time).
        self._scratch: list[torch.Tensor] = []

    @property
    def rank(self) -> int:
        return self._rdv.rank

    def receive(self, load_fn: LoadFn, *, timeout_s: float | None = None, aliases: bool = True) -> SyncStats:
        """Receive one sync and feed it to ``load_fn``; return its stats once the sender has been told.

        ``load_fn(named_tensors)`` is called once with an iterator of ``(name, tensor)`` in the
        sender's order. Nothing is yielded before its checksum is verified (on CPU each piece right
        before it is yielded, on a GPU each bucket before any of its tensors); a mismatch raises
        :class:`~rlhf_weightsync.errors.ChecksumError` (naming the bucket and tensor) out of the
        iterator. Tensors are views of the transport's buffers (shared memory, a GPU slot, a receive
        buffer) or, for tensors split across buckets, of a reused scratch buffer they are assembled
        in: a yielded tensor may be overwritten once the iterator advances, so copy what must
        outlive that (loading into a model does). If ``load_fn`` has a ``target_for(name)`` method
        (as :func:`~rlhf_weightsync.loaders.copy_into`'s callback does) returning a contiguous tensor
        of the wire dtype, shape and device, each verified piece of a split tensor is copied straight
        into it instead, and that tensor is what is yielded (one copy fewer).
        ``aliases``: also yield tied names (after their primary name), sharing the same tensor.
        ``timeout_s``: how long to wait for the sender to start this sync (default: the
        receiver's ``timeout_s``).

        If ``load_fn`` raises or stops early, or a checksum fails, the rest of the sync is still
        received (so sender and receivers stay in step), the sender's ``send`` raises naming this rank,
        and the error is re-raised here. Weights loaded from earlier buckets stay loaded.
        """
        self._check_ready()
        rdv, sync = self._rdv, self._sync
        rdv.wait([(f"sync/{sync}/manifest", 0)], what=f"the sender to start sync {sync}", timeout_s=timeout_s)
        t0 = time.perf_counter()
        manifest = Manifest.from_bytes(rdv.get(f"sync/{sync}/manifest"))
        stream = _BucketStream(
            manifest,
            self._transport,
            sync=sync,
            aliases=aliases,
            scratch=self._scratch,
            target_for=getattr(load_fn, "target_for", None),
        )
        with self._sync_threads():
            error = self._load(load_fn, stream)
        self._finish(error)
        if error is not None:
            raise error
        return SyncStats(
            version=manifest.version,
            num_tensors=len(manifest.tensors),
            num_names=stream.names_out,
            num_buckets=len(manifest.buckets),
            num_bytes=manifest.payload_bytes,
            seconds=time.perf_counter() - t0,
        )

    def _check_ready(self) -> None:
        """Refuse to start a sync on a closed receiver or one out of step with the sender."""
        if self._closed:
            raise WeightSyncError("receive() on a closed WeightReceiver")
        if self._broken:
            raise WeightSyncError(f"rank {self.rank} is out of step with the sender after: {self._broken}")

    def _load(self, load_fn: LoadFn, stream: _BucketStream) -> Exception | None:
        """Feed ``stream`` to ``load_fn``, then receive whatever it left; return its error, if any.

        An error of ``load_fn`` (or a checksum mismatch) is returned, not raised, so the rest of the
        sync is still received. Anything else (a failure of the transport, an interrupt) leaves this
        rank out of step: it marks the receiver broken and propagates, chained to ``load_fn``'s error
        if there was one.
        """
        sync, manifest = self._sync, stream.manifest
        error: Exception | None = None
        try:
            self._transport.begin(sync, [b.nbytes for b in manifest.buckets])
            try:
                load_fn(iter(stream))
                if not stream.finished:
                    error = WeightSyncError(
                        f"load_fn returned after {stream.tensors_out} of {len(manifest.tensors)} tensors; "
                        "it must consume the whole iterator"
                    )
            except Exception as exc:
                error = exc
            stream.drain()
        except BaseException as exc:
            self._broken = f"sync {sync} failed in transport: {type(exc).__name__}: {exc}"
            if error is not None and error is not exc:
                raise exc from error
            raise
        return error

    def _finish(self, error: Exception | None) -> None:
        """Tell the sender how this sync went (``ok`` or the error) and move on to the next sync."""
        if self._transport.device.type != "cpu":
            self._scratch.clear()  # do not hold GPU memory between syncs
        status = "ok" if error is None else f"{type(error).__name__}: {error}"
        self._rdv.set(f"sync/{self._sync}/done/{self.rank}", status.encode())
        self._sync += 1


class _BucketStream:
    """Iterator over one sync's tensors that pulls buckets from the transport as it goes."""

    def __init__(
        self,
        manifest: Manifest,
        transport: Transport,
        *,
        sync: int,
        aliases: bool,
        scratch: list[torch.Tensor],
        target_for: Callable[[str], torch.Tensor | None] | None = None,
    ) -> None:
        self.manifest, self.transport, self.sync, self.aliases = manifest, transport, sync, aliases
        self.scratch = scratch  # [] or [one flat uint8 buffer], shared with the receiver
        self.target_for = target_for
        self.next_bucket = 0
        self.held: int | None = None
        self.finished = False
        self.tensors_out = 0
        self.names_out = 0
        self._per_piece = transport.device.type == "cpu"

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._items()

    def _items(self) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = self.manifest.tensors
        partial: torch.Tensor | None = None
        target: torch.Tensor | None = None
        for index, bucket in enumerate(self.manifest.buckets):
            buf = self._take(index)
            # On CPU each piece is verified just before it is yielded (its bytes are then still in
            # cache for the load callback's copy); on a GPU the whole bucket at once (one sync).
            expected = (
                buf[bucket.trailer_offset : bucket.nbytes].view(torch.int64).tolist()
                if self._per_piece
                else None
            )
            for i, piece in enumerate(bucket.pieces):
                spec = tensors[piece.tensor]
                nbytes = piece.count * spec.itemsize
                if expected is not None:
                    got = int(word_sum(buf, piece.offset, nbytes))
                    if got != expected[i]:
                        raise self._mismatch(index, i, got, expected[i])
                view = buf[piece.offset : piece.offset + nbytes].view(spec.dtype)
                if piece.count == spec.numel:
                    tensor = view.view(spec.shape)
                else:
                    if piece.start == 0:
                        target, partial = self._direct_target(spec, buf.device), None
                        if target is None:
                            partial = self._scratch_for(spec.nbytes, buf.device)[: spec.nbytes].view(
                                spec.dtype
                            )
                        else:
                            partial = target.detach().view(-1)
                    assert partial is not None
                    with torch.no_grad():
                        partial[piece.start : piece.start + piece.count].copy_(view)
                    if piece.start + piece.count < spec.numel:
                        continue
                    tensor = partial.view(spec.shape) if target is None else target
                    partial = None
                self.tensors_out += 1
                self.names_out += 1
                yield spec.name, tensor
                if self.aliases:
                    for alias in spec.aliases:
                        self.names_out += 1
                        yield alias, tensor
            self._give(index)
        self.finished = True

    def _direct_target(self, spec: TensorSpec, device: torch.device) -> torch.Tensor | None:
        """The load callback's own tensor for ``spec`` if split pieces can be copied straight into it."""
        if self.target_for is None:
            return None
        dst = self.target_for(spec.name)
        if (
            dst is None
            or dst.dtype != spec.dtype
            or tuple(dst.shape) != spec.shape
            or dst.device != device
            or not dst.is_contiguous()
        ):
            return None
        return dst

    def _scratch_for(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if not self.scratch or self.scratch[0].numel() < nbytes or self.scratch[0].device != device:
            self.scratch[:] = [torch.empty(0, dtype=torch.uint8)]  # free the old one first
            self.scratch[0] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.scratch[0]

    def _take(self, index: int) -> torch.Tensor:
        buf = self.transport.wait(index)
        self.next_bucket, self.held = index + 1, index
        if not self._per_piece:
            self._verify(index, buf)
        return buf

    def _give(self, index: int) -> None:
        self.held = None
        self.transport.release(index)

    def _verify(self, index: int, buf: torch.Tensor) -> None:
        bucket, tensors = self.manifest.buckets[index], self.manifest.tensors
        got = torch.stack(
            [word_sum(buf, p.offset, p.count * tensors[p.tensor].itemsize) for p in bucket.pieces]
        )
        expected = buf[bucket.trailer_offset : bucket.nbytes].view(torch.int64)
        bad = (got != expected).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise self._mismatch(index, i, int(got[i]), int(expected[i]))

    def _mismatch(self, index: int, i: int, got: int, expected: int) -> ChecksumError:
        piece = self.manifest.buckets[index].pieces[i]
        spec = self.manifest.tensors[piece.tensor]
        return ChecksumError(
            f"bucket {index + 1}/{len(self.manifest.buckets)} of sync {self.sync} "
            f"(version {self.manifest.version}): checksum mismatch in tensor {spec.name!r} "
            f"(elements {piece.start}..{piece.start + piece.count} of {spec.numel}): "
            f"got {got & (2**64 - 1):#018x}, expected {expected & (2**64 - 1):#018x}"
        )

    def drain(self) -> None:
        """Release the held bucket and receive (unverified, unused) every bucket not yet taken."""
        if self.held is not None:
            self._give(self.held)
        for index in range(self.next_bucket, len(self.manifest.buckets)):
            self.transport.wait(index)
            self.transport.release(index)
        self.next_bucket = len(self.manifest.buckets)
