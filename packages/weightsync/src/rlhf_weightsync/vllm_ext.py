"""A vLLM worker extension that joins a sync group and loads received weights into the engine.

vLLM mixes this class into its worker when given
``LLM(..., worker_extension_cls="rlhf_weightsync.vllm_ext.WeightSyncWorkerExtension")``; its methods
are then called on every worker through ``llm.collective_rpc(name, kwargs=...)``. This module does
not import vllm (the worker already has), and the class adds only the three public methods below
(vLLM refuses extension attributes that clash with the worker's). ``receive_weights`` returns a plain
dict (:class:`~rlhf_weightsync.stats.WeightSyncReport`): ``collective_rpc`` hands it back unchanged.

Loading goes through the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``,
which re-runs vLLM's post-load processing: on the CPU backend the forward uses pre-packed copies
of the GEMM weights that a plain ``model.load_weights`` would leave stale. Its layer-wise reload
keeps loaded tensors until a layer is complete, so each tensor is cloned out of the transport's
buffer first; and it re-processes only layers that received weights, so a tied ``lm_head`` is fed
the embedding explicitly (see ``_owned_with_tied_head``). There is no fallback to a plain
``load_weights``: on a worker without ``reload_weights``, ``receive_weights`` raises a
``RuntimeError`` saying so, from its load callback before any tensor is loaded, so the sync is still
drained (sender and receivers stay in step) and the sender's ``send`` raises a ``WeightSyncError``
naming this rank and that reason instead of waiting for a timeout. Call ``llm.reset_prefix_cache()``
after every update: cached prompt KV from old weights would otherwise be reused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from rlhf_weightsync.stats import WeightSyncReport

__all__ = ["WeightSyncWorkerExtension"]


def _tensor_parallel_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _ties_embeddings(worker) -> bool:
    try:
        config = worker.model_runner.model_config.hf_config
    except AttributeError:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # A vision-language config may say it on the whole model only (Qwen3-VL), which vLLM then ties.
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def _owned_with_tied_head(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, tied: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Clones of the received tensors; for a model with tied embeddings, ``lm_head.weight`` too.

    vLLM reloads layer by layer and re-processes only layers that received weights: a tied
    ``lm_head`` that gets nothing keeps its stale pre-packed copy on CPU. A sender that walked
    ``named_parameters()`` lists the tied weight once (as ``...embed_tokens.weight``), so the head is
    fed the same tensor here unless the sync already named it.
    """
    seen: set[str] = set()
    embed = None
    for name, tensor in named_tensors:
        owned = tensor.clone()
        seen.add(name)
        if name.endswith("embed_tokens.weight"):
            embed = owned
        yield name, owned
    if tied and embed is not None and "lm_head.weight" not in seen:
        yield "lm_head.weight", embed


class WeightSyncWorkerExtension:
    """Methods added to each vLLM worker; the worker's rank in the sync group is
    ``rank_offset + <its tensor-parallel rank>`` (the sender is rank 0)."""

    def init_weight_sync(
        self,
        *,
        transport: str,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        timeout_s: float = 60.0,
    ) -> None:
        """Join the sync group (blocks until the sender and every other receiver have joined)."""
        from rlhf_weightsync.receiver import WeightReceiver

        if getattr(self, "_rlhf_weightsync_receiver", None) is not None:
            raise RuntimeError(
                "init_weight_sync: this worker already joined a sync group; close_weight_sync first"
            )
        if rank_offset < 1:
            raise ValueError(f"rank_offset: expected >= 1 (rank 0 is the sender), got {rank_offset}")
        device = getattr(self, "device", None) if transport in ("nccl", "cuda_ipc") else None
        self._rlhf_weightsync_receiver = WeightReceiver(
            transport=transport,  # type: ignore[arg-type]
            master_addr=master_addr,
            master_port=master_port,
            rank=rank_offset + self._rlhf_sync_rank(),
            world_size=world_size,
            timeout_s=timeout_s,
            device=device,
        )

    def receive_weights(self, *, timeout_s: float | None = None) -> WeightSyncReport:
        """Receive one sync, verify it and load it; return its :class:`SyncStats` as a plain-dict
        :class:`WeightSyncReport` (``SyncStats.from_report`` rebuilds them).

        ``timeout_s`` bounds the wait for the sender to start the sync (default: the group's timeout).
        """
        receiver = getattr(self, "_rlhf_weightsync_receiver", None)
        if receiver is None:
            raise RuntimeError("receive_weights: call init_weight_sync first")

        stats = receiver.receive(self._rlhf_load_callback(), timeout_s=timeout_s, aliases=True)
        return stats.to_report()

    # Hooks a subclass for another kind of worker overrides (private names: vLLM refuses extension
    # attributes that clash with its worker's).
    def _rlhf_sync_rank(self) -> int:
        """This worker's offset in the engine's part of the sync group: its tensor-parallel rank."""
        return _tensor_parallel_rank()

    def _rlhf_load_callback(self):
        """The load callback for ``WeightReceiver.receive``: vLLM's ``reload_weights``."""
        reload = getattr(self, "reload_weights", None)

        def load(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
            # Raised in here, before any tensor is taken, rather than before ``receive``: the
            # receiver then drains the sync and reports this reason to the sender, whose ``send``
            # raises with it (raising before ``receive`` would leave the sender waiting for a timeout).
            if not callable(reload):
                raise RuntimeError(
                    f"receive_weights: the vLLM worker {type(self).__name__} has no "
                    "reload_weights(weights_iterator=..., is_checkpoint_format=True); it is needed so "
                    "vLLM's post-load processing re-runs (a plain model.load_weights would leave stale "
                    "pre-packed GEMM weights on the CPU backend). Nothing was loaded; use a vLLM "
                    "version whose worker has reload_weights."
                )
            reload(
                weights_iterator=_owned_with_tied_head(named_tensors, tied=_ties_embeddings(self)),
                is_checkpoint_format=True,
            )

        return load

    def close_weight_sync(self) -> None:
        """Leave the sync group (no-op if not joined)."""
        receiver = getattr(self, "_rlhf_weightsync_receiver", None)
        if receiver is not None:
            self._rlhf_weightsync_receiver = None
            receiver.close()
