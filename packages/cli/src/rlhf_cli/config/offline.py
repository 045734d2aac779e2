"""Configuration trees of the offline commands: ``rlhf sft``, ``rm``, ``dpo``, ``kto`` (training on a
fixed data set, one trained group plus an optional frozen reference), ``serve-rm`` and ``lora-merge``.
They share ``--learner``, ``--ckpt``, ``--logger`` and ``--ray`` with ``rlhf ppo``."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator
from rlhf_algos.preference import DPOVariant
from rlhf_learner import LoraOptions, ModelOptions, StrategyOptions

from rlhf_cli.config._base import Section
from rlhf_cli.config.models import RefConfig, TrainedGroup
from rlhf_cli.config.run import (
    CkptConfig,
    ExportConfig,
    LoggerConfig,
    RayConfig,
    check_learner_fields,
    check_split,
    data_parallel_size,
    fitting_micro_batch,
)

__all__ = [
    "DPOConfig",
    "KTOConfig",
    "LoraMergeConfig",
    "OfflineConfig",
    "RMConfig",
    "SFTConfig",
    "ServeRMConfig",
]


_GROUP_NAMES = {"ref": "reference"}

TINY_MODEL_LR = 1e-3
"""What the built-in tiny model (random weights, 0.36M parameters) trains well with."""


class ModelConfig(TrainedGroup):
    pretrain: str | None = None
    """Hugging Face folder to start from; unset: the built-in tiny model (built offline)."""
    lr: float | None = Field(None, gt=0)
    """Learning rate; unset: 1e-3 for the built-in tiny model (no pretrain given), else the command's
    default for full fine-tuning of real LLMs (sft 5e-6, rm 9e-6, dpo and kto 5e-7; LoRA adapters usually
    want a larger one, around 1e-4: set it)."""
    options: ModelOptions = Field(default_factory=ModelOptions)
    """How the transformers model is built (attention kernel, gradient checkpointing, dtype)."""


class PreferenceRefConfig(RefConfig):
    precompute: bool = False
    """Score every example with the reference once before training, then stop its group (frees it)."""


class ExampleData(Section):
    path: Path | None = None
    """A JSONL file or a local datasets folder; unset: the built-in task's examples."""
    input_key: str = "prompt"
    """Field holding the prompt (text, or chat messages), as in rlhf ppo (old name: --data.prompt_key)."""
    image_key: str | None = "images"
    """Field holding a row's images (sft and dpo on a vision-language model), as in rlhf ppo."""
    apply_chat_template: bool = False
    """Render text prompts with the tokenizer's chat template."""
    max_len: int = Field(512, ge=2)
    """Longest example in tokens (prompt + response); longer ones are skipped."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many examples."""


class SFTData(ExampleData):
    response_key: str = "response"
    """Field holding the target response text."""
    messages_key: str = "messages"
    """Field holding a whole conversation (used when a row has no response field; the last message is the target)."""
    train_on_prompt: bool = False
    """Also train on the prompt tokens (default: the loss is on the response only)."""


class PairData(ExampleData):
    chosen_key: str = "chosen"
    """Field holding the preferred response (text, or a whole conversation)."""
    rejected_key: str = "rejected"
    """Field holding the dispreferred response."""


class KTOData(ExampleData):
    completion_key: str = "completion"
    """Field holding the response."""
    label_key: str = "label"
    """Field holding true (desirable) or false (undesirable)."""


class OfflineTrain(Section):
    num_epochs: int = Field(1, ge=1)
    """Passes over the training examples."""
    num_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (e.g. a short trial run), as in rlhf ppo; unset: num_epochs
    passes (old name: --train.max_steps)."""
    batch_size: int = Field(32, ge=1)
    """Examples (pairs for rm and dpo) per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = Field(8, ge=1)
    """Examples per forward/backward on each rank (the rest is gradient accumulation); unset: the largest
    size up to 8 that splits each rank's share of --train.batch_size evenly."""
    seed: int = 42
    """Seed of data order, held-out split and model initialisation."""
    max_restarts: int = Field(3, ge=0)
    """When a learner rank, an engine or a host dies, start the run again in this driver from its latest
    checkpoint (from step 0 without one), at most this many times; 0: stop at the first death, naming it."""
    elastic: bool = False
    """A restart after a lost host spans the nodes left: a group over more nodes than remain takes fewer,
    with fewer data-parallel ranks that accumulate more micro-batches (the batch unchanged). Needs a
    --learner.backend that loads a checkpoint on fewer ranks (fsdp2)."""


class PackedTrain(OfflineTrain):
    packing: bool = True
    """Pack each micro-batch's examples into one row without padding (position ids restart per example)."""


class OfflineEval(Section):
    path: Path | None = None
    """Evaluation examples (same format as data.path); unset: a held-out split of the training data."""
    split: float = Field(0.1, ge=0, lt=1)
    """Fraction of the training examples held out for evaluation when eval.path is unset (0: none)."""
    every: int = Field(10, ge=0)
    """Evaluate every N steps, and before the first and after the last; 0: never."""
    max_samples: int | None = Field(256, ge=1)
    """Evaluate on at most this many examples."""


class DPOAlgo(Section):
    loss: DPOVariant = "dpo"
    """dpo (Rafailov et al.), ipo (Azar et al.) or cdpo (conservative DPO, with label_smoothing)."""
    beta: float = Field(0.1, gt=0)
    """Strength of the KL constraint to the reference (IPO: its regularisation)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """cdpo only: the assumed probability that a preference label is flipped."""
    nll_coef: float = Field(0.0, ge=0)
    """Add this times the chosen responses' per-token NLL (RPO-style regulariser)."""

    @model_validator(mode="after")
    def _smoothing(self) -> DPOAlgo:
        if self.label_smoothing and self.loss != "cdpo":
            raise ValueError(f"label_smoothing: used by --algo.loss cdpo only, not {self.loss}")
        return self


class KTOAlgo(Section):
    beta: float = Field(0.1, gt=0)
    """Strength of the KL constraint to the reference."""
    desirable_weight: float = Field(1.0, gt=0)
    """Weight of desirable examples (lambda_D)."""
    undesirable_weight: float = Field(1.0, gt=0)
    """Weight of undesirable examples (lambda_U)."""


class OfflineConfig(Section):
    """What every offline training command shares."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    learner: StrategyOptions = Field(default_factory=lambda: StrategyOptions(zero_stage=2, grad_clip=1.0))
    """How the trained group (and the frozen reference) run: the training backend (deepspeed or fsdp2),
    sharding, precision, offload and the optimizer (old name: --ds)."""
    train: OfflineTrain = Field(default_factory=OfflineTrain)
    eval: OfflineEval = Field(default_factory=OfflineEval)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    command: ClassVar[str] = "offline"
    common_flags: ClassVar[tuple[str, ...]] = (
        "model.pretrain",
        "data.path",
        "model.lr",
        "train.batch_size",
        "train.num_epochs",
        "train.num_steps",
        "learner.backend",
        "logger.run_dir",
        "ckpt.load_enable",
    )
    """What most runs set: ``--help`` shows them first."""
    pretrained_lr: ClassVar[float] = 5e-6
    """Default learning rate when --model.pretrain is given (a real model)."""
    frozen_group: ClassVar[str | None] = None
    """The section of the frozen group the command runs beside the trained one (``ref`` for dpo and
    kto, ``teacher`` for distill), which is also the group's name in the plan; None: none."""

    @property
    def frozen(self) -> PreferenceRefConfig | None:
        """The frozen group's section (``pretrain``, ``precompute`` and its shape), or None."""
        return getattr(self, self.frozen_group) if self.frozen_group else None

    def derived_values(self) -> dict[str, object]:
        """Unset settings whose value the run derives (``--print-config`` shows it beside the null)."""
        return {"model.lr": self.learning_rate} if self.model.lr is None else {}

    @property
    def learning_rate(self) -> float:
        if self.model.lr is not None:
            return self.model.lr
        return self.pretrained_lr if self.model.pretrain is not None else TINY_MODEL_LR

    @property
    def grad_accum_steps(self) -> int:
        return (
            self.train.batch_size
            // data_parallel_size(self.model.world_size, self.learner)
            // self.train.micro_batch_size
        )

    @model_validator(mode="after")
    def _shared_checks(self) -> OfflineConfig:
        check_learner_fields(self.learner, {"lr": "--model.lr"})
        if "micro_batch_size" not in self.train.model_fields_set:  # the largest that fits, up to the default
            shard = self.train.batch_size // data_parallel_size(self.model.world_size, self.learner)
            train = self.train.model_copy()
            train.micro_batch_size = fitting_micro_batch([shard], train.micro_batch_size)
            self.train = train
        model = "model (--model.num_nodes x --model.num_devices_per_node)"
        check_split(
            self.train.batch_size,
            "--train.batch_size",
            self.model.world_size,
            model,
            self.learner,
            self.train.micro_batch_size,
        )
        frozen = self.frozen
        if frozen is not None and not frozen.precompute:
            check_split(
                self.train.batch_size,
                "--train.batch_size",
                frozen.world_size,
                _GROUP_NAMES.get(self.frozen_group, self.frozen_group),
                self.learner,
                None,
            )
        if self.command == "rm" and (
            self.learner.sequence_parallel_size > 1 or self.learner.tensor_parallel_size > 1
        ):
            raise ValueError(
                "--learner.sequence_parallel_size / --learner.tensor_parallel_size: rlhf rm's reward model runs neither "
                "(sequence and tensor parallelism are for policies and references)"
            )
        if self.model.options.compile and self.learner.zero_stage == 3:
            raise ValueError(
                "--model.options.compile with --learner.zero_stage 3: torch.compile runs with ZeRO stages 0-2 here"
            )
        lora = getattr(self, "lora", None)
        if lora is not None and self.learner.zero_stage == 3:
            raise ValueError("--lora with --learner.zero_stage 3: LoRA runs with ZeRO stages 0-2 here")
        if lora is not None and self.learner.tensor_parallel_size > 1:
            raise ValueError(
                "--lora with --learner.tensor_parallel_size > 1: DeepSpeed's AutoTP does not train LoRA models"
            )
        return self


class SFTLogger(LoggerConfig):
    run_dir: Path = Path("runs/sft")
    """Run folder: metrics.jsonl, TensorBoard logs, the loss curve, checkpoints and the final model."""


class RMLogger(LoggerConfig):
    run_dir: Path = Path("runs/rm")
    """Run folder: metrics.jsonl, TensorBoard logs, the loss curve, checkpoints and the final model."""


class DPOLogger(LoggerConfig):
    run_dir: Path = Path("runs/dpo")
    """Run folder: metrics.jsonl, TensorBoard logs, the loss curve, checkpoints and the final model."""


class KTOLogger(LoggerConfig):
    run_dir: Path = Path("runs/kto")
    """Run folder: metrics.jsonl, TensorBoard logs, the loss curve, checkpoints and the final model."""


class SFTConfig(OfflineConfig):
    """``rlhf sft``: supervised fine-tuning on prompt/response pairs or conversations (loss on the responses)."""

    data: SFTData = Field(default_factory=SFTData)
    train: PackedTrain = Field(default_factory=PackedTrain)
    lora: LoraOptions | None = None
    """LoRA adapters (set any field, e.g. --lora.rank 8, to switch it on); the adapter is saved too."""
    logger: SFTLogger = Field(default_factory=SFTLogger)
    command: ClassVar[str] = "sft"


class RMConfig(OfflineConfig):
    """``rlhf rm``: a pairwise (Bradley-Terry) reward model on chosen/rejected data; the saved model carries
    its score normalisation (mean and std over the training responses)."""

    data: PairData = Field(default_factory=PairData)
    logger: RMLogger = Field(default_factory=RMLogger)
    command: ClassVar[str] = "rm"
    pretrained_lr: ClassVar[float] = 9e-6


class _WithReference(OfflineConfig):
    ref: PreferenceRefConfig = Field(default_factory=PreferenceRefConfig)
    """The frozen reference policy (its own Ray group)."""
    lora: LoraOptions | None = None
    """LoRA adapters on the trained policy (set any field, e.g. --lora.rank 8, to switch it on)."""
    frozen_group: ClassVar[str | None] = "ref"


class DPOConfig(_WithReference):
    """``rlhf dpo``: direct preference optimisation (DPO, IPO or cDPO) against a frozen reference."""

    data: PairData = Field(default_factory=PairData)
    algo: DPOAlgo = Field(default_factory=DPOAlgo)
    logger: DPOLogger = Field(default_factory=DPOLogger)
    command: ClassVar[str] = "dpo"
    pretrained_lr: ClassVar[float] = 5e-7


class KTOConfig(_WithReference):
    """``rlhf kto``: Kahneman-Tversky optimisation on unpaired desirable/undesirable examples."""

    data: KTOData = Field(default_factory=KTOData)
    algo: KTOAlgo = Field(default_factory=KTOAlgo)
    logger: KTOLogger = Field(default_factory=KTOLogger)
    command: ClassVar[str] = "kto"
    pretrained_lr: ClassVar[float] = 5e-7


class ServeOptions(Section):
    host: str = "127.0.0.1"
    """Address to bind (127.0.0.1: this machine only; any other address needs a token)."""
    port: int = Field(8600, ge=0, le=65535)
    """Port to listen on (0: any free port, printed at start-up)."""
    token: str | None = None
    """Bearer token every request must carry (also read from RLHF_REWARD_TOKEN); unset: none."""
    max_body_bytes: int = Field(4 * 2**20, ge=1024)
    """Largest request body accepted; larger ones get HTTP 413."""
    batch_size: int = Field(16, ge=1)
    """Sequences per forward pass."""
    max_len: int = Field(2048, ge=2)
    """Longest sequence scored (tokens), at most the model's positions; longer ones are cut to their last
    max_len tokens."""


class ServedModel(Section):
    pretrain: str | None = None
    """The reward-model folder to serve (what rlhf rm writes to its final_model)."""


class ServeRMConfig(Section):
    """``rlhf serve-rm``: score query + response texts (or token ids) with a reward model over HTTP."""

    reward: ServedModel = Field(default_factory=ServedModel)
    serve: ServeOptions = Field(default_factory=ServeOptions)
    command: ClassVar[str] = "serve-rm"

    @model_validator(mode="after")
    def _model_given(self) -> ServeRMConfig:
        if self.reward.pretrain is None:
            raise ValueError("--reward.pretrain: give the reward-model folder to serve")
        return self


class LoraMergeConfig(Section):
    """``rlhf lora-merge``: fold a LoRA adapter into its base model and write a plain Hugging Face folder."""

    base: str | None = None
    """The base model folder the adapter was trained on."""
    adapter: str | None = None
    """The adapter folder (adapter_config.json + adapter weights), e.g. an SFT run's final_adapter."""
    out: Path | None = None
    """Folder to write the merged model and the base's tokenizer to."""
    force: bool = False
    """Merge even into a base whose weights are not those the adapter was trained on (its recorded base
    folder or saved fingerprint says which)."""
    command: ClassVar[str] = "lora-merge"

    @model_validator(mode="after")
    def _given(self) -> LoraMergeConfig:
        for name in ("base", "adapter", "out"):
            if getattr(self, name) is None:
                raise ValueError(f"--{name}: required")
        return self
