"""Actor and reference models: per-token log-probs of given tokens under a causal LM."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from rlhf_learner.models.layout import ModelCall, model_call
from rlhf_learner.models.loading import (
    ModelOptions,
    check_compile,
    check_model_dir,
    compile_model,
    input_positions,
    zero3_construction,
    zero_stage,
)
from rlhf_learner.models.logprobs import (
    entropy_from_logits,
    next_token_logprobs,
    shift_to_inputs,
    token_logprobs,
)
from rlhf_learner.models.vision import (
    FROZEN_TOWER_MODULES,
    check_vision_compile,
    freeze_vision_tower,
    is_vision_language,
)

if TYPE_CHECKING:
    from rlhf_learner.lora import LoraOptions

__all__ = ["Actor", "ActorOutput", "load_causal_lm", "load_reference"]


def _per_token(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, *, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[R, L-1]`` log-probs of tokens ``1..L-1`` of each row from ``[R, L, vocab]`` logits (column ``j``
    predicts token ``j + 1``), and the entropies of those predictions when ``entropy``."""
    logp = next_token_logprobs(logits, input_ids[:, 1:], temperature=temperature)
    return logp, entropy_from_logits(logits[:, :-1], temperature=temperature) if entropy else None


def _per_token_fused(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, *, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_per_token` as whole-tensor formulas, for the compiler to fuse (it makes no float32 copy)."""
    z = logits[:, :-1].float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = (z.gather(-1, input_ids[:, 1:, None]).squeeze(-1) - lse).to(logits.dtype)
    return logp, entropy_from_logits(logits[:, :-1], temperature=temperature) if entropy else None


@functools.cache
def _compiled_per_token() -> Any:
    """``_per_token_fused`` compiled (at its first call); made on first use: ``torch.compile`` imports the
    compiler, seconds that a process without a compiled model need not pay."""
    return torch.compile(_per_token_fused, dynamic=True)


class ActorOutput(NamedTuple):
    logp: torch.Tensor
    """``[B, T]``: ``log pi(x_t | x_<t)`` of each input token; 0 where no prediction exists
    (column 0 and the first token of each packed sequence)."""
    entropy: torch.Tensor | None
    """``[B, T]`` entropy of the distribution that predicted token ``t`` (same alignment), or None."""
    aux_loss: torch.Tensor | None
    """The mixture-of-experts router auxiliary loss, when requested and the model has one."""
    vocab_logp: torch.Tensor | None = None
    """``[N, V]``: the whole distribution (log-probs, float32) that predicted each ``vocab_logp_at`` token
    (row-major), when requested (distillation)."""


def _vocab_logp_at(
    logits: torch.Tensor, at: torch.Tensor, call: ModelCall, temperature: float
) -> torch.Tensor:
    """``[N, V]`` float32 log-softmax of the predictions of the ``at`` tokens (``[B, T]`` as the caller laid
    the rows out; row-major), each the prediction made at the token before it in the kernel's layout. Only
    these rows of the logits are normalised: nothing ``[B, T, V]`` in float32 is made."""
    rows, width = logits.shape[:2]
    flat = call.back(torch.arange(rows * width, device=logits.device).view(rows, width))
    where = flat[at.to(logits.device).bool()]
    first = where % width == 0
    if call.starts is not None:
        first |= call.starts.reshape(-1).to(logits.device)[where] == 0
    if bool(first.any()):
        raise ValueError("vocab_logp_at: a sequence's first token has no prediction")
    picked = logits.reshape(rows * width, -1)[where - 1].float()
    return torch.log_softmax(picked / temperature if temperature != 1.0 else picked, dim=-1)


def load_causal_lm(
    path: str | Path,
    *,
    options: ModelOptions | None = None,
    ds_config: dict[str, Any] | None = None,
    lora: LoraOptions | None = None,
) -> nn.Module:
    """Load a ``*ForCausalLM`` folder with transformers, after checking it.

    Under a ZeRO-3 ``ds_config`` the model is built partitioned (see :func:`zero3_construction`). With
    ``lora`` the result is the peft model (:func:`~rlhf_learner.lora.apply_lora`); with
    ``lora.load_in_4bit`` its base is loaded in 4-bit NF4 first (QLoRA: CUDA + bitsandbytes, not ZeRO-3,
    else a ValueError naming ``load_in_4bit``).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    options = options or ModelOptions()
    check_compile(options, ds_config)
    cfg = check_model_dir(path, need_tokenizer=False)
    check_vision_compile(cfg, compile=options.compile)
    vision = is_vision_language(cfg)
    if options.liger and not vision:
        from liger_kernel.transformers import AutoLigerKernelForCausalLM

        cls: Any = AutoLigerKernelForCausalLM
    else:
        cls = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    if lora is not None and lora.load_in_4bit:
        from rlhf_learner.lora import check_4bit, load_qlora_base

        check_4bit(zero_stage=zero_stage(ds_config))
        model = load_qlora_base(
            path,
            attn_implementation=options.attn_implementation,
            gradient_checkpointing=options.gradient_checkpointing,
            model_class=cls,
        )
    else:
        with zero3_construction(ds_config, cfg.get("model_type", "")):
            model = cls.from_pretrained(
                str(path), dtype=options.torch_dtype, attn_implementation=options.attn_implementation
            )
        if options.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if options.gradient_checkpointing:
        model.config.use_cache = False
    if vision and options.freeze_vision_tower:
        freeze_vision_tower(model)
    if lora is not None:
        from rlhf_learner.lora import apply_lora

        frozen_tower = vision and options.freeze_vision_tower
        model = apply_lora(model, lora, exclude=FROZEN_TOWER_MODULES if frozen_tower else None)
    compile_model(model, options)
    return model


class Actor(nn.Module):
    """A causal LM that returns per-token log-probs (and optionally entropies) of its input tokens.

    Inputs are either padded rows (``attention_mask``) or packed rows (``position_ids`` restarting at
    0 for each sequence and no ``attention_mask``; see :mod:`rlhf_learner.packing`). The per-token
    values are computed in the layout the attention kernel was given (``for_kernel``), compiled with
    ``compile``, and put back as ``[B, T]``.

    With ``sequence_parallel_group`` every rank of that group gets the same full rows, computes its
    contiguous chunk of the sequence with ring attention (:mod:`rlhf_learner.ring_attention`), and the
    per-token results are gathered (differentiably) so each rank returns the full ``[B, T]``. Rows must
    be right-padded (or unpadded), or packed; packed rows are split like any row, and the ring masks
    attention across their sequences. When the group is the whole
    data-parallel world (pure sequence parallelism) the update steps need no change: every rank sees the
    same loss, and DeepSpeed's gradient average over the group sums the chunks' contributions.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        temperature: float = 1.0,
        sequence_parallel_group: Any = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.model = model
        self.temperature = temperature
        self.compile_head = compile
        """Compute the log-probs (and entropies) from the logits in compiled code, fused each way (pass the
        model's ``ModelOptions.compile``: the logits then come from compiled code too)."""
        self.sp_group = sequence_parallel_group
        if sequence_parallel_group is not None:
            from rlhf_learner.ring_attention import use_ring_attention

            use_ring_attention(model, sequence_parallel_group)

    @property
    def config(self) -> Any:
        return self.model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_entropy: bool = False,
        return_aux_loss: bool = False,
        vocab_logp_at: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
    ) -> ActorOutput:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected [batch, time], got shape {tuple(input_ids.shape)}")
        packed = position_ids  # as the caller gave them: packed rows
        position_ids = input_positions(self.config, input_ids, attention_mask, position_ids)
        if vocab_logp_at is not None and self.sp_group is not None:
            raise ValueError("vocab_logp_at: not with sequence parallelism (each rank holds a chunk)")
        if self.sp_group is not None:
            if pixel_values is not None:
                raise ValueError("pixel_values: image rows are not split for sequence parallelism")
            return self._ring_forward(input_ids, attention_mask, packed, return_entropy)
        call = model_call(
            self.model,
            input_ids,
            attention_mask=attention_mask,
            packed=packed,
            positions=position_ids,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            mm_token_type_ids=mm_token_type_ids,
        )
        if return_aux_loss:
            if not hasattr(self.config, "output_router_logits"):
                raise ValueError(
                    "aux_loss_coef: the model is not a mixture-of-experts model (no router logits)"
                )
            call.kwargs["output_router_logits"] = True
        out = call.run(self.model)
        # Per token in the kernel's layout, where each sequence is still contiguous (its first token,
        # position 0, has no prediction: masked), then back: [R, L] values move, not [R, L, vocab] logits.
        head = _compiled_per_token() if self.compile_head else _per_token
        lp, ent = head(out.logits, call.ids, self.temperature, entropy=return_entropy)
        starts, back = call.starts, call.back
        logp = back(shift_to_inputs(lp, starts))
        entropy = back(shift_to_inputs(ent, starts)) if ent is not None else None
        aux = getattr(out, "aux_loss", None) if return_aux_loss else None
        vocab = (
            None
            if vocab_logp_at is None
            else _vocab_logp_at(out.logits, vocab_logp_at, call, self.temperature)
        )
        return ActorOutput(logp, entropy, aux, vocab)

    def _ring_forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        packed: torch.Tensor | None,
        return_entropy: bool,
    ) -> ActorOutput:
        import torch.distributed as dist

        from rlhf_learner.ring_attention import PACKED_ROWS, gather_sequence, split_sequence

        if attention_mask is not None:
            m = attention_mask.long()
            if (m[:, 1:] > m[:, :-1]).any():
                raise ValueError("sequence parallelism: attention_mask must be right-padded")
        b, t = input_ids.shape
        size = dist.get_world_size(self.sp_group)
        width = -(-t // size) * size
        ids = torch.nn.functional.pad(input_ids, (0, width - t))
        nxt = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        if packed is None:
            pos = torch.arange(width, device=ids.device).expand(b, width)
        else:  # padding: each pad token a sequence of its own (position 0)
            pos = torch.nn.functional.pad(packed, (0, width - t))
        local = self.model(
            input_ids=split_sequence(ids, group=self.sp_group),
            position_ids=split_sequence(pos, group=self.sp_group),
            use_cache=False,
            **({PACKED_ROWS: True} if packed is not None else {}),
        ).logits
        labels = split_sequence(nxt, group=self.sp_group)
        # Column j of the gathered tensor predicts token j + 1; shift onto the inputs.
        lp = gather_sequence(token_logprobs(local, labels, temperature=self.temperature), group=self.sp_group)
        logp = shift_to_inputs(lp[:, : t - 1], packed)
        entropy = None
        if return_entropy:
            ent = gather_sequence(
                entropy_from_logits(local, temperature=self.temperature), group=self.sp_group
            )
            entropy = shift_to_inputs(ent[:, : t - 1], packed)
        return ActorOutput(logp, entropy, None)


def load_reference(
    path: str | Path,
    *,
    options: ModelOptions | None = None,
    ds_config: dict[str, Any] | None = None,
    temperature: float = 1.0,
    sequence_parallel_group: Any = None,
) -> Actor:
    """A frozen actor (eval mode, no gradients) for reference log-probs. Pass an inference ZeRO-3
    ``ds_config`` (``build_ds_config(..., train=False)``) to shard it, then wrap it with
    ``Strategy.prepare(..., train=False)``. ``sequence_parallel_group``: as for :class:`Actor`."""
    model = load_causal_lm(path, options=options, ds_config=ds_config)
    model.eval()
    model.requires_grad_(False)
    ref = Actor(
        model,
        temperature=temperature,
        sequence_parallel_group=sequence_parallel_group,
        compile=options is not None and options.compile,
    )
    ref.eval()
    return ref
