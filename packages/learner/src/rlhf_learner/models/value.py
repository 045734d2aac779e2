"""Critic and reward model: a scalar head on a transformer trunk.

Both are stored as a ``*ForSequenceClassification`` folder with ``num_labels=1`` (trunk + ``score``
head), the layout transformers and vLLM read for reward models. The reward model's optional
normalisation (``normalize_reward``, ``reward_mean``, ``reward_std``) lives in that folder's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_learner.models.layout import model_call
from rlhf_learner.models.loading import (
    ModelOptions,
    check_compile,
    check_model_dir,
    compile_model,
    input_positions,
    zero3_construction,
)
from rlhf_learner.models.logprobs import shift_to_inputs
from rlhf_learner.models.vision import (
    check_vision_compile,
    check_vision_language,
    freeze_vision_tower,
    is_vision_language,
)

__all__ = [
    "Critic",
    "RewardModel",
    "VisionValueModel",
    "has_score_head",
    "last_token_index",
    "load_critic",
    "load_reward_model",
]


def last_token_index(
    attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Flat indices into ``[B * T]`` of the last real token of each sequence.

    Padded rows (``attention_mask``, left or right padding): one index per row, the last 1.
    Packed rows (``position_ids``): one index per sequence, the position before each restart at 0, in
    row-major order (a packed row's tail padding counts as a sequence; callers drop it).
    """
    if attention_mask is not None:
        b, t = attention_mask.shape
        idx = torch.arange(t, device=attention_mask.device).expand(b, t)
        last = torch.where(attention_mask.bool(), idx, -1).max(-1).values
        if (last < 0).any():
            raise ValueError("attention_mask: a row has no real token")
        return last + torch.arange(b, device=last.device) * t
    if position_ids is None:
        raise ValueError("need attention_mask or position_ids")
    b, t = position_ids.shape
    starts = position_ids == 0
    ends = torch.zeros_like(starts)
    ends[:, :-1] = starts[:, 1:]
    ends[:, -1] = True
    return ends.flatten().nonzero().squeeze(-1)


class Critic(nn.Module):
    """A value model. :meth:`values` is the scalar head on every hidden state, ``V(x_<=t)`` at column
    ``t``; calling the critic gives the same values aligned with the actor's log-probs (see
    :meth:`forward`), which is what GAE and the critic loss take."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not hasattr(model, "score"):
            raise ValueError(
                f"{type(model).__name__} has no 'score' head; expected a *ForSequenceClassification"
            )
        self.model = model

    @property
    def config(self) -> Any:
        return self.model.config

    def values(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        packed = position_ids if attention_mask is None else None
        positions = input_positions(self.config, input_ids, attention_mask, position_ids)
        call = model_call(
            self.model,
            input_ids,
            attention_mask=attention_mask,
            packed=packed,
            positions=positions,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            mm_token_type_ids=mm_token_type_ids,
        )
        trunk = call.run(self.model.base_model)
        return self.model.score(call.back(trunk.last_hidden_state)).squeeze(-1).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **images: torch.Tensor,
    ) -> torch.Tensor:
        """``[B, T]`` state values aligned with the tokens: column ``t`` holds ``V(x_<t)``, the value of
        the state in which token ``t`` was chosen (the head read at ``t - 1``), as ``Actor``'s
        ``logp[:, t]`` is ``log pi(x_t | x_<t)``. So ``values[:, t]`` and ``logp[:, t]`` describe the same
        action, which is the pairing GAE's ``delta_t = r_t + gamma V_{t+1} - V_t`` needs. Column 0 and,
        for packed rows, each sequence's first token have no preceding state and hold 0. ``images``: a
        vision-language critic's ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids``."""
        v = self.values(input_ids, attention_mask=attention_mask, position_ids=position_ids, **images)
        return shift_to_inputs(v[:, :-1], position_ids)


class VisionValueModel(nn.Module):
    """A vision-language model's trunk (vision tower and language model) under a scalar ``score`` head:
    transformers has no ``*ForSequenceClassification`` for the Qwen2-VL family. The head starts fresh."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model.model  # the trunk of a *ForConditionalGeneration (its LM head is dropped)
        self.config = model.config
        text = getattr(model.config, "text_config", model.config)
        self.score = nn.Linear(text.hidden_size, 1, bias=False, dtype=model.dtype)
        nn.init.normal_(self.score.weight, std=getattr(text, "initializer_range", 0.02))

    @property
    def base_model(self) -> nn.Module:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()


class RewardModel(Critic):
    """One scalar per sequence: the head read at the sequence's last real token, optionally
    normalised with the ``reward_mean`` / ``reward_std`` stored in the config."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        normalize: bool | None = None,
    ) -> torch.Tensor:
        if attention_mask is None and position_ids is None:
            attention_mask = torch.ones_like(input_ids)
        v = self.values(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        scores = v.flatten()[
            last_token_index(attention_mask, None if attention_mask is not None else position_ids)
        ]
        if normalize if normalize is not None else getattr(self.config, "normalize_reward", False):
            scores = (scores - self.config.reward_mean) / self.config.reward_std
        return scores

    def set_normalization(self, *, mean: float, std: float) -> None:
        """Store reward statistics in the config (saved with the model) and switch normalisation on."""
        if std <= 0:
            raise ValueError(f"reward std must be positive, got {std}")
        self.config.normalize_reward = True
        self.config.reward_mean = float(mean)
        self.config.reward_std = float(std)


def _load_scalar_model(path: str | Path, options: ModelOptions | None, ds_config: dict[str, Any] | None):
    from transformers import AutoModelForSequenceClassification

    options = options or ModelOptions()
    check_compile(options, ds_config)
    cfg = check_model_dir(path, need_causal_lm=False, need_tokenizer=False)
    if is_vision_language(cfg):
        return _load_vision_value_model(path, cfg, options, ds_config)
    archs = cfg.get("architectures") or []
    if not any(a.endswith(("ForCausalLM", "ForSequenceClassification")) for a in archs):
        raise ValueError(
            f"model folder {str(path)!r}: architectures={archs!r}; expected a causal LM or a reward model"
        )
    with zero3_construction(ds_config, cfg.get("model_type", "")):
        model = AutoModelForSequenceClassification.from_pretrained(
            str(path),
            num_labels=1,
            dtype=options.torch_dtype,
            attn_implementation=options.attn_implementation,
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = cfg.get("eos_token_id")
    if options.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compile_model(model.base_model, options)  # the trunk: Critic.values calls it and the head apart
    return model


def _load_vision_value_model(
    path: str | Path, cfg: dict[str, Any], options: ModelOptions, ds_config: dict[str, Any] | None
) -> VisionValueModel:
    from transformers import AutoModelForImageTextToText

    check_vision_language(cfg, where=f"model folder {str(path)!r}")
    check_vision_compile(cfg, compile=options.compile)
    with zero3_construction(ds_config, cfg.get("model_type", "")):
        lm = AutoModelForImageTextToText.from_pretrained(
            str(path), dtype=options.torch_dtype, attn_implementation=options.attn_implementation
        )
        model = VisionValueModel(lm)
    if options.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if options.freeze_vision_tower:
        freeze_vision_tower(model)
    compile_model(model.base_model, options)
    return model


def has_score_head(path: str | Path) -> bool:
    """Whether a model folder holds a trained ``score`` head (a reward model or critic saved as
    ``*ForSequenceClassification``): from its safetensors headers (no tensor is read), else, for ``.bin``
    weights, its config's architectures. A causal LM has none: loaded for scoring, its head would be new
    and random."""
    import json

    from safetensors import safe_open

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text()).get("weight_map", {}))
    else:
        names = set()
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as weights:
                names.update(weights.keys())
    if names:
        return any(n == "score.weight" or n.endswith(".score.weight") for n in names)
    archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs)


def load_critic(
    path: str | Path, *, options: ModelOptions | None = None, ds_config: dict[str, Any] | None = None
) -> Critic:
    """A critic from a causal LM (fresh head) or a reward-model folder (its trained head)."""
    return Critic(_load_scalar_model(path, options, ds_config))


def load_reward_model(
    path: str | Path, *, options: ModelOptions | None = None, ds_config: dict[str, Any] | None = None
) -> RewardModel:
    """A reward model from a causal LM (fresh head, for RM training) or a reward-model folder."""
    return RewardModel(_load_scalar_model(path, options, ds_config))
