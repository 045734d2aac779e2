"""How big each group's model is, as the memory estimate needs it: parameters, widths and layers from a
folder's config (built on the meta device: nothing is loaded), and the activation memory of a micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_learner.models.loading import max_positions

from rlhf_cli.config import ConfigError, OfflineConfig, PPOConfig

__all__ = [
    "ModelShape",
    "ModelSizes",
    "activation_bytes",
    "check_positions",
    "check_reward_model",
    "check_same_tokens",
    "check_top_k",
    "count_params",
    "model_shape",
    "model_sizes",
]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """One model as the memory estimate needs it: parameters, hidden size h, layers L, vocabulary v, K width
    per layer and token (num_key_value_heads x head_dim), whether a scalar value head replaces the LM
    head (critic, reward model), and the longest sequence its config allows (``max_positions``; None:
    the config does not say)."""

    params: int
    hidden: int
    layers: int
    vocab: int
    kv_dim: int
    value_head: bool = False
    positions: int | None = None


@dataclass(frozen=True, kw_only=True)
class ModelSizes:
    """Each group's own model; ``of`` gives the actor's (offline: the trained model's) for an unset one
    and for ``model`` and ``engines``."""

    actor: ModelShape
    critic: ModelShape | None = None
    ref: ModelShape | None = None
    reward: ModelShape | None = None
    teacher: ModelShape | None = None

    def of(self, group: str) -> ModelShape:
        return getattr(self, group, None) or self.actor


def _meta_params(config: Any, *, value_head: bool) -> int:
    """Parameters of ``config``'s model built on the meta device (nothing allocated): the causal LM (a
    tied head counted once; a vision-language model's vision tower included), or with ``value_head`` the
    backbone (``AutoModel``) plus a 1-row scalar head of ``hidden_size`` weights, as
    ``*ForSequenceClassification`` with one label has it."""
    import torch
    from rlhf_learner.models import is_vision_language
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    lm = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = (AutoModel if value_head else lm).from_config(config)
    n = sum(p.numel() for p in model.parameters())
    return n + (config.get_text_config().hidden_size if value_head else 0)


def count_params(model_dir: Path) -> int:
    """Parameters of a Hugging Face folder as a causal LM, from its config on the meta device."""
    return model_shape(model_dir, flag="the model folder").params


def _shape(text: Any, params: int, value_head: bool) -> ModelShape:
    """A ``ModelShape`` from a text config (or a ``TinyModelSpec``: the same field names)."""
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_dim = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    dims = {"hidden": text.hidden_size, "layers": text.num_hidden_layers, "vocab": text.vocab_size}
    positions = max_positions(text)
    return ModelShape(params=params, kv_dim=kv_dim, value_head=value_head, positions=positions, **dims)


def model_shape(
    model_dir: Path | str | None,
    *,
    value_head: bool = False,
    flag: str = "--actor.pretrain",
    demo: str = "small",
) -> ModelShape:
    """A Hugging Face folder's shape from ``AutoConfig`` (``value_head``: see ``_meta_params``; ``flag``
    names the folder when it has no config.json). ``None``: the built-in ``demo`` model, from ``DEMO_MODELS``
    and ``demo_num_params()`` (tied embeddings: a value head adds h)."""
    if model_dir is None:
        from rlhf_cli.demo.task import DEMO_MODELS, demo_num_params
        from rlhf_cli.demo.tiny_model import TinyModelSpec

        spec = TinyModelSpec(**DEMO_MODELS[demo])
        return _shape(spec, demo_num_params(demo) + (spec.hidden_size if value_head else 0), value_head)
    from transformers import AutoConfig

    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"{flag} {model_dir}: no config.json (not a Hugging Face model folder)")
    config = AutoConfig.from_pretrained(str(model_dir))
    return _shape(config.get_text_config(), _meta_params(config, value_head=value_head), value_head)


def check_positions(length: int, flag: str, models: dict[str, ModelShape | None]) -> None:
    """ConfigError when sequences of ``length`` tokens (``flag``) are longer than a model's config allows
    (``ModelShape.positions``): caught in the plan, in one line, rather than by vLLM in each engine's
    start-up or by a learner rank at the first long sequence."""
    for who, shape in models.items():
        if shape is not None and shape.positions is not None and length > shape.positions:
            raise ConfigError(
                f"{flag} {length} is longer than the {who}'s {shape.positions} positions (from its "
                f"config.json); set {flag} {shape.positions} or less"
            )


def check_top_k(
    top_k: int | None, sizes: ModelSizes, flag: str = "--algo.top_k", *, sequence_parallel: int = 1
) -> None:
    """``--algo.top_k`` (rlhf distill), ``--algo.distill.top_k`` (rlhf ppo): at most the student's vocabulary,
    and whole next-token distributions on each rank (not split by sequence parallelism)."""
    if top_k is not None and top_k > sizes.actor.vocab:
        raise ConfigError(f"{flag} {top_k}: more than the model's vocabulary of {sizes.actor.vocab} tokens")
    if top_k is not None and sequence_parallel > 1:
        raise ConfigError(
            f"{flag} with --learner.sequence_parallel_size {sequence_parallel}: each rank holds a part of a "
            "sequence, not its whole next-token distributions; set it to 1"
        )


def check_reward_model(path: Path | str, flag: str = "--reward.pretrain") -> None:
    """ConfigError naming ``flag`` when the folder that scores samples has no trained ``score`` head (a
    causal LM: its head would be new and random, and so would every reward)."""
    from rlhf_learner.models import has_score_head

    if not has_score_head(path):
        raise ConfigError(
            f"{flag} {path}: no trained score head (a causal LM, not a reward model): its rewards would be "
            "random; train one with rlhf rm"
        )


def _tokenizer(folder: Path | str | None) -> Any | None:
    """The folder's tokenizer; None without one (or for the built-in demo, not built yet)."""
    from rlhf_learner.models.loading import TOKENIZER_FILES

    if folder is None or not any((Path(folder) / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def check_same_tokens(
    mine: Any | None, policy: ModelShape, other_dir: Path | str, other: ModelShape, *, flag: str
) -> None:
    """ConfigError naming ``flag`` when the model at ``other_dir`` (reference, critic, reward model) would
    read the policy's token ids as other tokens: its tokenizer's vocabulary is not the policy's (``mine``,
    loaded once by the caller; None: unknown), or it embeds fewer tokens than the policy's tokenizer has.
    One tokenizer over embeddings padded to different sizes passes."""
    theirs = _tokenizer(other_dir)
    if mine is not None and theirs is not None and mine.get_vocab() != theirs.get_vocab():
        raise ConfigError(
            f"{flag} {other_dir}: its tokenizer is not the policy's ({mine.name_or_path}), so it would read "
            "the policy's token ids as other tokens; give a model with the policy's tokenizer"
        )
    needed = len(mine) if mine is not None else policy.vocab
    if other.vocab < needed:
        raise ConfigError(
            f"{flag} {other_dir}: embeds {other.vocab} tokens, fewer than the {needed} of the policy's "
            "vocabulary; give a model with the policy's tokenizer"
        )


def model_sizes(cfg: PPOConfig | OfflineConfig, actor_dir: Path | str | None = None) -> ModelSizes:
    """Each group's model from its own folder flag, else the policy's: ``actor_dir`` when resolved (the
    built demo), else ``--actor.pretrain`` / ``--model.pretrain`` (unset: the demo). The critic
    (``--critic.pretrain``), the reward model (``--reward.pretrain``) and ``rlhf rm``'s model have value
    heads; the reference is ``--ref.pretrain``, the teacher ``--teacher.pretrain``."""
    if not isinstance(cfg, PPOConfig):
        policy = actor_dir if actor_dir is not None else cfg.model.pretrain
        frozen_dir = cfg.frozen.pretrain if cfg.frozen is not None else None
        actor = model_shape(policy, value_head=cfg.command == "rm", flag="--model.pretrain")
        if not frozen_dir:
            return ModelSizes(actor=actor)
        flag = f"--{cfg.frozen_group}.pretrain"
        frozen = model_shape(frozen_dir, flag=flag)
        check_same_tokens(_tokenizer(policy), actor, frozen_dir, frozen, flag=flag)
        return ModelSizes(actor=actor, **{cfg.frozen_group: frozen})  # type: ignore[arg-type]
    policy = actor_dir if actor_dir is not None else cfg.actor.pretrain
    demo = cfg.train.demo_model
    actor = model_shape(policy, demo=demo)
    critic: ModelShape | None = None
    ref: ModelShape | None = None
    reward: ModelShape | None = None
    teacher = None
    if cfg.distills:  # (the distillation demo's teacher: the large demo model)
        teacher = model_shape(cfg.teacher.pretrain, flag="--teacher.pretrain", demo="large")
    if cfg.uses_critic:
        flag = "--critic.pretrain" if cfg.critic.pretrain else "--actor.pretrain"
        critic = model_shape(cfg.critic.pretrain or policy, value_head=True, flag=flag, demo=demo)
    if cfg.uses_reference and cfg.ref.pretrain:
        ref = model_shape(cfg.ref.pretrain, flag="--ref.pretrain")
    if cfg.reward.source == "model":
        reward = model_shape(cfg.reward.pretrain, value_head=True, flag="--reward.pretrain")
        check_reward_model(cfg.reward.pretrain)
    others = {
        "--critic.pretrain": (cfg.critic.pretrain, critic),
        "--ref.pretrain": (cfg.ref.pretrain, ref),
        "--reward.pretrain": (cfg.reward.pretrain, reward),
        "--teacher.pretrain": (cfg.teacher.pretrain, teacher),
    }
    given = {flag: (f, shape) for flag, (f, shape) in others.items() if f is not None and shape is not None}
    mine = _tokenizer(policy) if given else None  # loaded once for all of them
    for flag, (folder, shape) in given.items():  # each reads the policy's token ids
        check_same_tokens(mine, actor, folder, shape, flag=flag)
    return ModelSizes(actor=actor, critic=critic, ref=ref, reward=reward, teacher=teacher)


def activation_bytes(
    shape: ModelShape, seq_len: int, rows: int, *, trains: bool, checkpointing: bool, bits16: bool
) -> float:
    """Peak activation memory (bytes) of one micro-batch of ``rows`` sequences of ``seq_len`` tokens.
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198), Sec. 4, without tensor / sequence parallelism, 16-bit activations: a transformer
    layer stores ``s*b*h*(34 + 5*a*s/h)`` bytes; the attention-score term ``5as/h`` is dropped (sdpa /
    flash attention never store the scores), leaving ``34*s*b*h`` per layer. Training keeps all L layers'
    (``34*s*b*h*L``); with gradient checkpointing (full recomputation) only each layer's input,
    ``2*s*b*h*L``, plus one layer's ``34*s*b*h`` while it is recomputed; a forward without gradients
    (frozen groups) holds about one layer's ``34*s*b*h``. An LM head adds its fp32 logits ``4*s*b*v``
    (the paper's output-layer term); a value head none. fp32 activations double the per-layer terms."""
    sbh = seq_len * rows * shape.hidden * (1 if bits16 else 2)
    kept = 0 if not trains else 2 if checkpointing else 34  # per layer, kept for the backward pass
    working = 0 if trains and not checkpointing else 34  # the one layer being run (or recomputed)
    body = (kept * shape.layers + working) * sbh
    return float(body + (0 if shape.value_head else 4 * seq_len * rows * shape.vocab))
