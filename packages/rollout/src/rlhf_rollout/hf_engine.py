"""transformers engine: batched ``generate`` with left padding; on CPU it can beat vLLM on toy models."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rlhf_rollout.engine import (
    EngineCapabilities,
    UnsupportedOperationError,
    WeightSyncReport,
    check_prompts,
)
from rlhf_rollout.images import ImagePrompt, prompt_images
from rlhf_rollout.types import Generation, SamplingParams

__all__ = ["TransformersEngine", "process_logits"]


def process_logits(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution's log-probabilities for ``logits [..., vocab]``.

    ``logits / temperature`` (``temperature == 0``: unchanged, greedy), then everything outside the
    ``top_k`` largest and outside the smallest prefix of the sorted distribution whose mass reaches
    ``top_p`` is set to ``-inf``, then ``log_softmax``. The same order as vLLM's sampler.
    """
    x = logits.float()
    if temperature > 0:
        x = x / temperature
    if top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - top_p
        drop_sorted[..., -1:] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


class _Recorder:
    """A logits processor placed last: applies :func:`process_logits` and records, one step later, the
    logprob of the token ``generate`` sampled from it (so only one ``[batch, vocab]`` is kept alive)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.pending: torch.Tensor | None = None
        self.logprobs: list[torch.Tensor] = []

    def take(self, sampled: torch.Tensor) -> None:
        if self.pending is not None:
            self.logprobs.append(self.pending.gather(-1, sampled[:, None])[:, 0])
            self.pending = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.take(input_ids[:, -1])
        p = self.params
        logp = process_logits(scores, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        self.pending = logp
        return logp


class TransformersEngine:
    """A transformers causal LM behind the :class:`~rlhf_rollout.engine.RolloutEngine` protocol.

    Prompts are repeated ``n`` times, sorted by length, cut into batches of ``max_batch_size`` rows,
    left-padded and passed to ``model.generate``; the sampling distribution is
    :func:`process_logits` (generate's own warpers are switched off). A sample ends at the model's
    EOS or any stop token (kept in the output) or at ``max_new_tokens`` / ``max_model_len``.
    """

    def __init__(
        self,
        *,
        model: Any,
        dtype: str | torch.dtype = "float32",
        device: str | None = None,
        max_model_len: int | None = None,
        max_batch_size: int = 256,
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
        worker_extension_cls: str | None = None,
        image_processor: Any = None,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        self.image_processor = image_processor
        if isinstance(model, torch.nn.Module):
            self.model = model
        else:
            dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
            vision = getattr(AutoConfig.from_pretrained(str(model)), "vision_config", None) is not None
            cls = AutoModelForImageTextToText if vision else AutoModelForCausalLM
            self.model = cls.from_pretrained(str(model), dtype=dt)
            if vision and image_processor is None:
                from transformers import AutoImageProcessor

                self.image_processor = AutoImageProcessor.from_pretrained(str(model))
        if device is not None:
            self.model.to(device)
        self.model.eval()
        self.device = next(self.model.parameters()).device
        config = self.model.config
        gen = self.model.generation_config
        if eos_token_ids is None:
            eos = gen.eos_token_id if gen.eos_token_id is not None else config.eos_token_id
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        pad = pad_token_id if pad_token_id is not None else gen.pad_token_id
        if pad is None:
            pad = config.pad_token_id if config.pad_token_id is not None else (self.eos_token_ids or (0,))[0]
        self.pad_token_id = int(pad)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        limit = max_model_len or getattr(text, "max_position_embeddings", None)
        if limit is None:
            raise ValueError("max_model_len: the model config has no max_position_embeddings; pass it")
        self._max_model_len = int(limit)
        self._vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self._worker = _extended_worker(worker_extension_cls, self.model, self.device)

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            backend="transformers",
            sleep=False,
            prefix_cache=False,
            weight_sync_extension=self._worker is not None,
            load_weights=True,
            notes="no sleep mode (move the model yourself); no prefix cache (reset is a no-op); "
            "weight updates through load_weights(named_tensors)"
            + ("" if self._worker is not None else "; weight sync needs worker_extension_cls"),
        )

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        check_prompts(prompts, max_model_len=self._max_model_len, vocab_size=self._vocab_size)
        rows = [(i, j) for i in range(len(prompts)) for j in range(params.n)]
        rows.sort(key=lambda r: len(prompts[r[0]]))
        results: dict[tuple[int, int], Generation] = {}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(rows), self.max_batch_size):
                chunk = rows[start : start + self.max_batch_size]
                gens = self._generate_batch([prompts[i] for i, _ in chunk], params)
                results.update(zip(chunk, gens, strict=True))
        return [[results[(i, j)] for j in range(params.n)] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[Sequence[int]], params: SamplingParams) -> list[Generation]:
        from transformers import GenerationConfig, LogitsProcessorList

        longest = max(len(p) for p in prompts)
        max_new = min(params.max_new_tokens, self._max_model_len - min(len(p) for p in prompts))
        ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, longest - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[r, longest - len(p) :] = 1
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        config = GenerationConfig(
            do_sample=not params.greedy,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            # an empty list, not None: generate fills None from the model's config (its EOS)
            eos_token_id=sorted(stops),
            pad_token_id=self.pad_token_id,
        )
        recorder = _Recorder(params)
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder]),
            **{k: v.to(self.device) for k, v in self._image_inputs(prompts, ids).items()},
        )
        new = out[:, longest:].cpu()
        recorder.take(out[:, longest + len(recorder.logprobs)].to(recorder.pending.device))
        logprobs = torch.stack(recorder.logprobs, dim=1).cpu() if recorder.logprobs else None
        gens = []
        for r, p in enumerate(prompts):
            row = new[r].tolist()
            room = self._max_model_len - len(p)
            end, reason = min(len(row), room), "length"
            for t, tok in enumerate(row[:end]):
                if tok in stops:
                    end, reason = t + 1, "stop"
                    break
            lp = logprobs[r, :end].tolist() if logprobs is not None else []
            if not params.logprobs:  # recorded anyway (the recorder is what samples), dropped as asked
                lp = [math.nan] * end
            gens.append(Generation(token_ids=row[:end], logprobs=lp, finish_reason=reason))
        return gens

    def _image_inputs(self, prompts: list[Sequence[int]], ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The images of left-padded rows (``ids``): pixels in row order, and each row's image tokens
        (those of its :class:`ImagePrompt`'s images) as ``mm_token_type_ids``."""
        pictured = [p for p in prompts if prompt_images(p)]
        if not pictured:
            return {}
        if self.image_processor is None:
            raise ValueError(
                "a prompt has images, but this engine has no image processor (a text-only model, or a module "
                "given without image_processor=)"
            )
        out = self.image_processor(
            images=[i for p in pictured for i in prompt_images(p)], return_tensors="pt"
        )
        kinds = torch.zeros_like(ids, dtype=torch.int32)
        for r, p in enumerate(prompts):
            if isinstance(p, ImagePrompt):
                kinds[r, ids.shape[1] - len(p) :] = torch.tensor(p.image_mask(), dtype=torch.int32)
        return {
            "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"],
            "mm_token_type_ids": kinds,
        }

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(name, tensor)`` pairs into the model's parameters/buffers; returns the count.

        Raises ``ValueError`` naming an unknown name or a shape mismatch (nothing is half-applied for
        a bad name: all names are checked first)."""
        state = self.model.state_dict(keep_vars=True)
        pairs = list(named_tensors)
        for name, tensor in pairs:
            if name not in state:
                raise ValueError(f"load_weights: {name!r} is not a parameter or buffer of the model")
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(state[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in pairs:
                state[name].copy_(tensor)
        return len(pairs)

    # --- weight sync: forwarded to the worker extension, as VLLMEngine does ----------------------------
    def _extension(self, method: str) -> Any:
        if self._worker is None:
            raise UnsupportedOperationError(
                f"{method}: this TransformersEngine was built without worker_extension_cls (e.g. "
                "'rlhf_weightsync.module_ext.ModuleWeightSyncExtension'); or call load_weights(named_tensors)"
            )
        return getattr(self._worker, method)

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
        """Join the sync group as rank ``rank_offset`` (blocks until everyone joined)."""
        self._extension("init_weight_sync")(
            transport=transport,
            master_addr=master_addr,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            timeout_s=timeout_s,
        )

    def receive_weights(self, *, timeout_s: float | None = None) -> WeightSyncReport:
        """Receive one sync into the model; returns the extension's report, as ``VLLMEngine`` does."""
        report: WeightSyncReport = self._extension("receive_weights")(timeout_s=timeout_s)
        return report

    def close_weight_sync(self) -> None:
        self._extension("close_weight_sync")()

    def sleep(self, *, level: int = 1) -> None:
        raise UnsupportedOperationError("TransformersEngine has no sleep mode; move the model yourself")

    def wake_up(self, *, tags: list[str] | None = None) -> None:
        raise UnsupportedOperationError("TransformersEngine has no sleep mode; move the model yourself")

    def reset_prefix_cache(self) -> None:
        """No prefix cache exists; nothing to reset (documented in ``capabilities``)."""

    def shutdown(self) -> None:
        self.model = None


class _ModuleWorker:
    """What a weight-sync worker extension sees of a TransformersEngine: its model and device."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device


def _extended_worker(extension_cls: str | None, model: torch.nn.Module, device: torch.device) -> Any:
    """A worker object with ``extension_cls`` (a dotted class path) mixed in, as vLLM does for its
    workers; ``None`` without an extension."""
    if extension_cls is None:
        return None
    import importlib

    module_name, _, cls_name = extension_cls.rpartition(".")
    try:
        ext = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"worker_extension_cls: cannot import {extension_cls!r} ({err})") from None
    return type("TransformersWorker", (ext, _ModuleWorker), {})(model, device)
