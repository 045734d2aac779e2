"""``rlhf distill``: offline knowledge distillation of a student (``--model``) from a frozen teacher
(``--teacher``, its own Ray group, or precomputed once) on prompt + response data."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator
from rlhf_algos import DistillLoss
from rlhf_learner import LoraOptions

from rlhf_cli.config._base import Section
from rlhf_cli.config.offline import OfflineConfig, PackedTrain, PreferenceRefConfig, SFTData
from rlhf_cli.config.run import LoggerConfig

__all__ = ["DistillConfig"]


class DistillTeacher(PreferenceRefConfig):
    pretrain: str | None = None
    """The teacher model folder (required): it must share the student's tokenizer, and may be larger."""
    precompute: bool = False
    """Score every training example with the teacher once before training, then stop its group (frees
    it; the targets are kept in the driver's memory: with a large vocabulary, set --algo.top_k)."""


class DistillAlgo(Section):
    loss: DistillLoss = "forward_kl"
    """forward_kl (KL(teacher || student), Hinton et al.), reverse_kl (KL(student || teacher), MiniLLM),
    or jsd (GKD's generalized Jensen-Shannon divergence, with beta), per response token."""
    beta: float = Field(0.5, gt=0, lt=1)
    """jsd only: the teacher's weight in the mixture (towards 0 it acts like forward KL, towards 1 like
    reverse KL)."""
    top_k: int | None = Field(None, ge=1)
    """Match the teacher's k most likely tokens at each position, plus one outcome for all the others
    (the student's mass elsewhere counts), which bounds the teacher's targets to k values a token; unset:
    the whole vocabulary."""

    @model_validator(mode="after")
    def _beta_for_jsd(self) -> DistillAlgo:
        if (
            self.beta != type(self).model_fields["beta"].default and self.loss != "jsd"
        ):  # (a saved config has it)
            raise ValueError(f"beta: used by --algo.loss jsd only, not {self.loss}")
        return self


class DistillLogger(LoggerConfig):
    run_dir: Path = Path("runs/distill")
    """Run folder: metrics.jsonl, TensorBoard logs, the loss curve, checkpoints and the final model."""


class DistillConfig(OfflineConfig):
    """``rlhf distill``: offline knowledge distillation from a frozen teacher on prompt + response data
    (forward KL, reverse KL or GKD's JSD; over the whole vocabulary or the teacher's top k)."""

    data: SFTData = Field(default_factory=SFTData)
    train: PackedTrain = Field(default_factory=PackedTrain)
    teacher: DistillTeacher = Field(default_factory=DistillTeacher)
    """The frozen teacher (its own Ray group)."""
    algo: DistillAlgo = Field(default_factory=DistillAlgo)
    lora: LoraOptions | None = None
    """LoRA adapters on the student (set any field, e.g. --lora.rank 8, to switch it on)."""
    logger: DistillLogger = Field(default_factory=DistillLogger)
    command: ClassVar[str] = "distill"
    frozen_group: ClassVar[str | None] = "teacher"
    pretrained_lr: ClassVar[float] = 1e-5
    common_flags: ClassVar[tuple[str, ...]] = (
        "model.pretrain",
        "teacher.pretrain",
        "data.path",
        "algo.loss",
        "algo.top_k",
        "model.lr",
        "train.batch_size",
        "train.num_steps",
        "logger.run_dir",
    )

    @model_validator(mode="after")
    def _distill_checks(self) -> DistillConfig:
        if self.teacher.pretrain is None:
            raise ValueError("--teacher.pretrain: give the teacher model folder (rlhf distill needs one)")
        if self.learner.sequence_parallel_size > 1 or self.learner.tensor_parallel_size > 1:
            raise ValueError(
                "--learner.sequence_parallel_size / --learner.tensor_parallel_size: rlhf distill runs "
                "neither (each rank needs whole next-token distributions)"
            )
        return self
