"""The run: training schedule, data, evaluation, checkpoints, logging and the Ray cluster."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from rlhf_learner import StrategyOptions

from rlhf_cli.config._base import Section
from rlhf_cli.runtime.learners.specs import ExportOptions

__all__ = [
    "LEARNER_FIELDS_SET_ELSEWHERE",
    "AsyncConfig",
    "CkptConfig",
    "DataConfig",
    "EvalConfig",
    "ExportConfig",
    "LoggerConfig",
    "RayConfig",
    "TrainConfig",
    "check_learner_fields",
    "check_split",
    "data_parallel_size",
    "fitting_micro_batch",
]

LEARNER_FIELDS_SET_ELSEWHERE = {
    "lr": "the group's --*.lr flag",
    "micro_batch_size": "--train.micro_batch_size",
    "grad_accum_steps": "--train.micro_batch_size (derived from the batch)",
    "seed": "--train.seed",
    "lr_schedule": "the group's --*.lr_scheduler, --*.lr_warmup_ratio / _steps and --*.min_lr flags",
}
"""StrategyOptions fields that each group takes from another flag; setting them under --learner is an error."""


def check_learner_fields(strategy: StrategyOptions, overrides: dict[str, str]) -> None:
    """Raise when ``--learner`` sets a field another flag owns (``overrides`` names the command's own flags)."""
    default = StrategyOptions()
    where = LEARNER_FIELDS_SET_ELSEWHERE | overrides
    for f in fields(StrategyOptions):
        if f.name in where and getattr(strategy, f.name) != getattr(default, f.name):
            raise ValueError(f"--learner.{f.name}: set it with {where[f.name]}")


def fitting_micro_batch(shards: list[int], cap: int | None) -> int:
    """The largest micro-batch, up to ``cap`` (None: no cap), that splits every rank's shard evenly: what
    an unset ``--train.micro_batch_size`` takes (a set one is checked, never changed)."""
    whole = max(1, math.gcd(*shards))
    return max(d for d in range(1, min(whole, cap or whole) + 1) if whole % d == 0)


def data_parallel_size(world: int, strategy: StrategyOptions) -> int:
    """Distinct data shards of a group of ``world`` ranks: blocks of ``--learner.sequence_parallel_size x
    --learner.tensor_parallel_size`` consecutive ranks share one (they split each sequence or each matrix)."""
    return world // (strategy.sequence_parallel_size * strategy.tensor_parallel_size)


def check_split(
    items: int, what: str, world: int, group: str, strategy: StrategyOptions, micro_batch_size: int
) -> None:
    """``items`` per step split evenly over ``group``'s data-parallel ranks, in micro-batches: or a
    one-line error naming the flags."""
    block = strategy.sequence_parallel_size * strategy.tensor_parallel_size
    if world % block:
        raise ValueError(
            f"the {group}'s {world} ranks cannot form blocks of --learner.sequence_parallel_size x "
            f"--learner.tensor_parallel_size = {block}"
        )
    if micro_batch_size is None:
        return
    dp = world // block
    per_rank, rest = divmod(items, dp)
    if rest:
        raise ValueError(
            f"{what} = {items} cannot be split evenly over the {group}'s {dp} data-parallel ranks"
        )
    if per_rank % micro_batch_size:
        raise ValueError(
            f"--train.micro_batch_size {micro_batch_size} does not divide the {per_rank} "
            f"{'samples' if 'sample' in what else 'examples'} each of the {group}'s {dp} data-parallel ranks "
            "trains on per step"
        )


class AsyncConfig(Section):
    max_staleness: int = Field(0, ge=0)
    """Weight versions a trained sample may lag the policy by (eta): 0 (the default) trains synchronously
    (generate, then train, then sync), and eta >= 1 has a producer generate ahead, starting a batch only
    while it stays within eta + 1 batches of the trainer (staleness bounded at admission, nothing dropped;
    needs vLLM)."""
    partial_rollout: bool = False
    """Let a weight update land mid-generation, the engines pausing at a token boundary to load it and going
    on (samples then mix versions and their staleness counts from their oldest token); needs
    max_staleness >= 1."""

    @model_validator(mode="after")
    def _partial_needs_async(self) -> AsyncConfig:
        if self.partial_rollout and self.max_staleness == 0:
            raise ValueError("--train.async.partial_rollout needs --train.async.max_staleness >= 1")
        return self

    @property
    def enabled(self) -> bool:
        return self.max_staleness > 0


class TrainConfig(Section):
    num_steps: int = Field(60, ge=1)
    """Training steps (one rollout batch and its updates each)."""
    micro_batch_size: int = Field(16, ge=1)
    """Samples per micro-batch on each data-parallel rank; unset: the largest size up to 16 that splits
    every rank's mini-batch evenly, or in the built-in demo (no model, data or reward given) a rank's whole
    mini-batch as one micro-batch."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""
    freeze_actor_steps: int = Field(0, ge=0)
    """PPO with a critic: the first N steps train the critic alone (the actor, and so the engines' weights,
    stay as they are), so that a critic started from a causal LM learns values before the policy moves on
    its advantages."""
    batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step (a PPO mini-batch): each pass takes rollout samples / batch_size
    optimizer steps over shuffled mini-batches; unset: the whole rollout batch (one step per pass)."""
    seed: int = 42
    """Seed of data order, sampling and model initialisation."""
    max_restarts: int = Field(3, ge=0)
    """When a learner rank, an engine or a host dies, start the run again in this driver from its latest
    checkpoint (from step 0 without one), at most this many times; 0: stop at the first death, naming it."""
    elastic: bool = False
    """A restart after a lost host spans the nodes left: a group over more nodes than remain takes fewer,
    with fewer data-parallel ranks that accumulate more micro-batches (the batch unchanged). Needs a
    --learner.backend that loads a checkpoint on fewer ranks (fsdp2)."""
    packing: bool = True
    """Pack each micro-batch's samples into rows without padding (position ids restart per sample)."""
    dynamic_batch: bool = False
    """Token-balanced micro-batches (similar token counts) instead of equal sample counts."""
    agent_func_path: Path | None = None
    """A .py file (it is executed: trust it) defining make_env() (a multi-turn reset/step environment),
    reward_func (single turn) or 'async def run_agent(*, base_url, api_key, prompt, label) -> float' (an
    agent that calls the policy with an OpenAI client at base_url, a server on 127.0.0.1 that records every
    call's exact tokens, and returns the episode's reward; its calls sample at --rollout.temperature / top_p
    with at most --rollout.max_new_tokens, and calls that extend the previous call's exact tokens, with
    extra_body={'return_token_ids': True}, form one trajectory, else the last call's sequence is trained
    on)."""
    max_turns: int = Field(4, ge=1)
    """Turns per multi-turn episode at most."""
    agent_timeout_s: float = Field(600.0, gt=0)
    """run_agent agents: seconds one episode (all its model calls) may take."""
    warmup_sft_steps: int = Field(40, ge=0)
    """Built-in demo only (no model, data or reward given): supervised steps on the answer format before RL."""
    demo_model: Literal["small", "large", "vlm"] = "small"
    """Built-in demo only: its tiny model, small (2 layers of 128) or large (3 layers of 192: the teacher
    the distillation demo trains first), or vlm: a tiny Qwen2-VL on the image task (a coloured shape, asked
    its colour or its shape)."""
    pin_cores: bool | None = None
    """CPU only: bind the engines to the first half of each node's cores and the learner ranks to the
    rest (their work then cannot steal each other's cores; an asynchronous run's reference ranks to none:
    they take what either half leaves idle); unset: pinned when training asynchronously."""
    colocate_all: bool = False
    """Hybrid engine, synchronous training only: the actor, critic, reference and reward groups and the
    rollout engines share the same bundles, so on GPUs the engines sleep while the learners train
    (--vllm.sleep_level) and weights go over CUDA IPC, and on CPU they share the cores."""
    colocate_actor_ref: bool = False
    """The actor and reference groups share bundles."""
    colocate_critic_reward: bool = False
    """The critic and reward-model groups share bundles."""
    overlap_reference: bool = True
    """Run a KL loss's reference forward while the actor's update starts, the actor's ranks fetching its
    log-probs when their loss needs them (synchronous runs with --algo.kl.use_loss, no KL in the reward, one
    optimizer step per rollout batch and the actor and reference on bundles of their own); false: the
    reference is scored first."""
    offload_during_rollout: bool = False
    """Colocated on GPU: the trained groups' DeepSpeed states go to host memory while the engines generate
    and come back before the update."""
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    """Asynchronous training: generation overlapping the updates."""

    @model_validator(mode="after")
    def _actor_trains(self) -> TrainConfig:
        if self.freeze_actor_steps and self.freeze_actor_steps >= self.num_steps:
            raise ValueError(
                f"freeze_actor_steps {self.freeze_actor_steps} leaves the actor none of the run's "
                f"{self.num_steps} steps (--train.num_steps)"
            )
        return self


class DataConfig(Section):
    path: Path | None = None
    """Prompts: a JSONL file or a local datasets folder; unset: the built-in task."""
    input_key: str = "input"
    """Field holding the prompt text (or a chat message list)."""
    label_key: str | None = "label"
    """Field holding the label the reward sees (None: no label)."""
    image_key: str | None = "images"
    """Field holding a row's images (vision-language models): one or a list of paths relative to the data
    file, base64 data URIs, or a datasets Image feature; each fills a '<image>' in the text, or a
    {"type": "image"} part of a message. Rows without it are text; none (null): no row has images."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template."""
    input_template: str | None = None
    """Instead of a chat template: text prompts put in this text at its '{}' (e.g. $'Question: {}\nAnswer:'
    in bash, where $'...' makes the newline), the evaluation prompts too."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many prompts."""
    strict: bool = False
    """Refuse a prompt that does not fit --rollout.max_model_len (default: skip it, count it in the log and the
    summary)."""

    @model_validator(mode="after")
    def _template(self) -> DataConfig:
        if self.input_template is not None and "{}" not in self.input_template:
            raise ValueError(f"input_template {self.input_template!r}: has no '{{}}' for the prompt")
        if self.input_template is not None and self.apply_chat_template:
            raise ValueError("input_template and apply_chat_template: give one way to format the prompts")
        return self


class EvalConfig(Section):
    path: Path | None = None
    """Evaluation prompts (same format as data.path); unset: the built-in task's eval split when training on it."""
    every: int = Field(5, ge=0)
    """Evaluate every N steps, and before the first and after the last; 0: never."""
    max_samples: int | None = Field(128, ge=1)
    """Evaluate on at most this many prompts."""
    pass_threshold: float = 1.0
    """An answer whose score is at least this counts as a pass (eval/pass_rate: the passing answers'
    fraction)."""
    temperature: float = Field(0.0, ge=0)
    """Sampling temperature of the answers; 0: greedy."""
    n_samples: int = Field(1, ge=1)
    """Answers per prompt; above 1 (sampled: --eval.temperature > 0) eval/pass_at_n is the fraction of
    prompts with a passing answer, and eval/pass_rate the fraction of passing answers (mean@n)."""

    @model_validator(mode="after")
    def _sampled(self) -> EvalConfig:
        if self.n_samples > 1 and self.temperature == 0:
            raise ValueError(
                f"n_samples {self.n_samples}: greedy answers (--eval.temperature 0) are all the same; "
                "set --eval.temperature"
            )
        return self


class CkptConfig(Section):
    save_steps: int = Field(0, ge=0)
    """Save a resumable checkpoint every N steps; 0: only the final export (a stopped run then starts
    again from step 0)."""
    save_minutes: float | None = Field(None, gt=0)
    """Also save when this many minutes have passed since the last save (or the start), which bounds the
    work a stop can cost whatever a step takes; unset: by steps alone."""
    load_enable: bool = False
    """Resume from the latest checkpoint in the run folder."""
    max_keep: int = Field(2, ge=1)
    """Checkpoints to keep (oldest deleted first)."""

    def plan_note(self) -> str:
        """What a stopped run could resume from, for the plan."""
        if not self.save_steps and self.save_minutes is None:
            return (
                "checkpoints: none (--ckpt.save_steps 0): a stopped run starts again from step 0; "
                "set --ckpt.save_steps or --ckpt.save_minutes"
            )
        when = [f"every {self.save_steps} steps"] if self.save_steps else []
        when += [f"every {self.save_minutes:g} minutes"] if self.save_minutes is not None else []
        return f"checkpoints: {' and '.join(when)}, the last {self.max_keep} kept"


class ExportConfig(Section):
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """dtype of final_model/'s weights: auto keeps the training dtype; bf16 halves the folder."""
    max_shard_gib: float = Field(5.0, gt=0)
    """Split final_model/, which rank 0 alone writes, into safetensors shards of at most this many GiB listed
    in model.safetensors.index.json (a smaller model is one model.safetensors)."""

    def options(self) -> ExportOptions:
        return ExportOptions(dtype=self.dtype, max_shard_bytes=int(self.max_shard_gib * 2**30))


class LoggerConfig(Section):
    run_dir: Path = Path("runs/ppo")
    """Run folder for metrics.jsonl, TensorBoard logs, curves, checkpoints and the final model; a folder that
    holds a previous run is refused unless --ckpt.load_enable resumes it or --logger.overwrite replaces it."""
    overwrite: bool = False
    """Replace the previous run in --logger.run_dir (its metrics, curves, checkpoints and final model are
    deleted first); without it such a folder is refused."""
    tensorboard: bool = True
    """Write TensorBoard event files to run_dir/tensorboard."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs the rlhf-cli[wandb] extra)."""
    progress: bool = True
    """Show progress: a live display on a terminal, a plain line per step otherwise (a log file, nohup, SLURM)."""


class RayConfig(Section):
    address: str | None = None
    """Join this Ray cluster (also read from RAY_ADDRESS); unset: start a local one on 127.0.0.1."""
    num_cpus: int | None = Field(None, ge=1)
    """Local cluster only: CPUs it offers (default: this machine's)."""
    cpus_per_worker: float = Field(0.25, gt=0)
    """CPUs each learner rank and each engine claims on a CPU-only cluster."""
    threads_per_rank: int | None = Field(None, ge=1)
    """torch threads of each learner rank and CPU engine; unset: its node's cores divided by its group's
    processes on the node (the stages of a step run one at a time, so the running group owns the cores)."""
    gpus_per_worker: float = Field(1.0, gt=0, le=1)
    """GPUs each learner rank and each engine worker claims; below 1 they share GPUs (weights then go over
    CUDA IPC; lower --rollout.gpu_memory_utilization to fit)."""
    timeout_s: float = Field(900.0, gt=0)
    """Timeout of every call into a Ray actor."""
