"""Build a tiny causal LM and a matching tokenizer offline, saved as a Hugging Face folder.

The folder loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` and with vLLM (CPU or GPU).
Nothing is downloaded: the weights are random (seeded) and the tokenizer is a byte-level BPE
trained in memory on a small synthetic corpus.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "TinyModelSpec", "build_tiny_model", "build_tokenizer"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the a an is are was be to of and in that it for on with as at by from this what which who how "
    "number guess higher lower correct answer question think step add plus minus times equals sum "
    "total result yes no maybe user assistant system hello world good bad reward policy value model "
    "train learn data token sample prompt response score true false left right up down one two "
    "three four five six seven eight nine ten"
).split()


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """Shape of the tiny model. Defaults give ~0.4M parameters that vLLM's CPU backend accepts."""

    architecture: str = "qwen2"
    """``qwen2`` or ``llama``."""
    vocab_size: int = 512
    """Tokenizer and embedding size (the byte alphabet needs 256 plus the special tokens)."""
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in ("qwen2", "llama"):
            raise ValueError(f"architecture: expected 'qwen2' or 'llama', got {self.architecture!r}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS) + 16:
            raise ValueError(f"vocab_size: {self.vocab_size} leaves no room for merges above 256 bytes")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.4:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            words += [str(a), "+", str(b), "=", str(a + b)]
        out.append(" ".join(words))
    return out


def build_tokenizer(*, vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with bos/eos/pad and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|eos|>", "<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def _config(spec: TinyModelSpec, tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    cls = Qwen2Config if spec.architecture == "qwen2" else LlamaConfig
    return cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def build_tiny_model(path: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a tiny random causal LM plus tokenizer to ``path`` and return it.

    The same ``spec`` always gives the same weights and tokenizer.
    """
    import torch
    from transformers import AutoModelForCausalLM

    spec = spec or TinyModelSpec()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # The embedding keeps a few spare rows above the tokenizer, as released models do.
    tokenizer = build_tokenizer(vocab_size=spec.vocab_size - 8, seed=spec.seed)
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={spec.vocab_size}")
    config = _config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger-than-default init so sampled text is not uniform noise and logprobs vary.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    from rlhf_learner.strategy.export import quiet_progress_bars

    with quiet_progress_bars():  # a shard-writing bar for a model that takes no time to write
        model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
