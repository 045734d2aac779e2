"""The root of ``rlhf ppo``'s configuration tree and the checks that span namespaces."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator
from rlhf_algos import ADVANTAGE_ESTIMATORS
from rlhf_learner import StrategyOptions

from rlhf_cli.config._base import Section
from rlhf_cli.config.algo import AlgoConfig
from rlhf_cli.config.models import ActorConfig, CriticConfig, RefConfig, RewardConfig, TeacherConfig
from rlhf_cli.config.ppo_checks import check_distillation, check_parallelism
from rlhf_cli.config.real_model import REAL_MODEL_DEFAULTS, demo_defaults, fill_unset, model_positions
from rlhf_cli.config.rollout import RolloutConfig, VLLMConfig, WeightSyncConfig
from rlhf_cli.config.run import (
    CkptConfig,
    DataConfig,
    EvalConfig,
    ExportConfig,
    LoggerConfig,
    RayConfig,
    TrainConfig,
    check_learner_fields,
    check_split,
    data_parallel_size,
    fitting_micro_batch,
)

__all__ = ["PPOConfig"]


class PPOConfig(Section):
    """``rlhf ppo``: PPO-family RL on Ray with rollout engines, learner groups and weight sync."""

    command: ClassVar[str] = "ppo"
    common_flags: ClassVar[tuple[str, ...]] = (
        "actor.pretrain",
        "data.path",
        "reward.func",
        "reward.remote_url",
        "algo.advantage.estimator",
        "rollout.batch_size",
        "rollout.n_samples_per_prompt",
        "rollout.max_new_tokens",
        "actor.lr",
        "train.num_steps",
        "rollout.num_engines",
        "learner.backend",
        "logger.run_dir",
        "ckpt.load_enable",
    )
    """What most runs set: ``--help`` shows them first."""

    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    weightsync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    learner: StrategyOptions = Field(default_factory=lambda: StrategyOptions(zero_stage=2, grad_clip=1.0))
    """How every learner group trains: the training backend (deepspeed or fsdp2), sharding, precision,
    offload and the optimizer (old name: --ds)."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @property
    def uses_critic(self) -> bool:
        return ADVANTAGE_ESTIMATORS[self.algo.advantage.estimator].uses_critic

    @property
    def uses_reference(self) -> bool:
        return self.algo.kl.enabled

    @property
    def distills(self) -> bool:
        """A teacher scores the samples (--teacher.pretrain, or the demo's): on-policy distillation runs."""
        return self.teacher.pretrain is not None or self.demo_teacher

    @property
    def demo_teacher(self) -> bool:
        """The built-in distillation demo (the distill estimator, and no model, teacher, data or reward
        given): the large demo model learns the task first (warm-up, then GRPO), then teaches."""
        no_models = self.teacher.pretrain is None and self.actor.pretrain is None
        return self.algo.advantage.estimator == "distill" and no_models and self.builtin_task

    @property
    def teacher_is_reference(self) -> bool:
        """The teacher's folder is the reference's: one group, loaded once, serves both."""
        t, r = self.teacher.pretrain, self.ref.pretrain
        both = t is not None and r is not None and self.uses_reference
        return both and Path(t).resolve() == Path(r).resolve()  # type: ignore[arg-type]

    @property
    def learner_dtype(self) -> str:
        """``--learner.precision`` as the engines' dtype that computes the same log-probs."""
        return {"bf16": "bfloat16", "fp32": "float32"}[self.learner.precision]

    @property
    def engine_dtype(self) -> str:
        """The engines' dtype, said explicitly (vLLM's ``auto`` would turn an fp32 checkpoint into bf16 on a
        GPU): ``--rollout.dtype``, or the learners' precision for ``auto``."""
        return self.learner_dtype if self.rollout.dtype == "auto" else self.rollout.dtype

    @property
    def rewarded(self) -> bool:
        """The estimator uses the samples' rewards (``distill`` alone does not)."""
        return ADVANTAGE_ESTIMATORS[self.algo.advantage.estimator].rewarded

    @property
    def builtin_task(self) -> bool:
        """No data and no reward given: the built-in task's prompts and reward (with the warm-up)."""
        return self.data.path is None and self.reward.source is None and self.train.agent_func_path is None

    @property
    def warmup_runs(self) -> bool:
        """The built-in supervised warm-up runs: the built-in task on the built-in model."""
        return self.builtin_task and self.actor.pretrain is None and self.train.warmup_sft_steps > 0

    @property
    def samples_per_step(self) -> int:
        return self.rollout.batch_size * self.rollout.n_samples_per_prompt

    @property
    def optimizer_batch_size(self) -> int:
        """Samples per optimizer step (``--train.batch_size``; unset: the whole rollout batch)."""
        return self.train.batch_size or self.samples_per_step

    @property
    def optimizer_steps_per_step(self) -> int:
        """Optimizer steps each training step takes (per trained group)."""
        return self.train.ppo_epochs * (self.samples_per_step // self.optimizer_batch_size)

    def total_optimizer_steps(self, group: str) -> int:
        """Optimizer steps of the whole run of ``group`` (actor or critic): what its learning-rate schedule
        spans (the actor's include the built-in demo's warm-up SFT steps, not ``--train.freeze_actor_steps``)."""
        if group != "actor":
            return self.train.num_steps * self.optimizer_steps_per_step
        warmup = self.train.warmup_sft_steps if self.warmup_runs else 0
        trained = max(0, self.train.num_steps - self.train.freeze_actor_steps)  # the frozen steps: none
        return trained * self.optimizer_steps_per_step + warmup

    @property
    def lr_scheduled(self) -> bool:
        """A trained group's learning rate follows a schedule (its curve depends on the run's length)."""
        return self.actor.lr_scheduled or (self.uses_critic and self.critic.lr_scheduled)

    @property
    def colocated(self) -> list[tuple[str, ...]]:
        """The sets of groups sharing bundles (``--train.colocate_*``), of the groups this run has."""
        t, present = self.train, {"actor", "engines"}
        present |= {"critic"} if self.uses_critic else set()
        present |= {"ref"} if self.uses_reference else set()
        present |= {"teacher"} if self.distills else set()
        present |= {"reward"} if self.reward.source == "model" else set()
        wanted = [("actor", "critic", "ref", "teacher", "reward", "engines")] if t.colocate_all else []
        wanted += [("actor", "ref")] if t.colocate_actor_ref and not t.colocate_all else []
        wanted += [("critic", "reward")] if t.colocate_critic_reward and not t.colocate_all else []
        sets = [tuple(g for g in w if g in present) for w in wanted]
        return [x for x in sets if len(x) > 1]

    @property
    def colocates_engines(self) -> bool:
        return any("engines" in s for s in self.colocated)

    @property
    def engines_drop_weights(self) -> bool:
        """Colocated engines sleep at level 2 (weights discarded): every sync sends a frozen tower too."""
        return self.colocates_engines and self.vllm.sleep_level == 2

    @property
    def pins_cores(self) -> bool:
        """Engines and learner ranks on disjoint cores (``--train.pin_cores``; unset: when asynchronous)."""
        return self.train.pin_cores if self.train.pin_cores is not None else self.train.async_.enabled

    @property
    def exactly_on_policy(self) -> bool:
        """One optimizer step per rollout batch and no KL in the reward: the policy that is updated is the
        one that was scored, so the old-policy forward is skipped (its log-probs are the current ones)."""
        return self.optimizer_steps_per_step == 1 and not self.algo.kl.reward_penalty and not self.distills

    @property
    def reference_overlaps_update(self) -> bool:
        """``--train.overlap_reference`` applies: the reference's log-probs feed the KL loss alone (not the
        reward, the advantages, an asynchronous producer, nor the experience stage's KL: the update is
        exactly on-policy, so that KL is the update's own), and the actor and reference share no bundles."""
        kl, t = self.algo.kl, self.train
        shared = any({"actor", "ref"} <= set(s) for s in self.colocated)
        return (
            t.overlap_reference
            and self.uses_reference
            and kl.use_loss
            and not kl.reward_penalty
            and not t.async_.enabled
            and self.exactly_on_policy
            and not shared
        )

    @property
    def grad_accum_steps(self) -> int:
        return (
            self.optimizer_batch_size
            // data_parallel_size(self.actor.world_size, self.learner)
            // self.train.micro_batch_size
        )

    @model_validator(mode="after")
    def _real_model_defaults(self) -> PPOConfig:
        """With --actor.pretrain, the settings the user left unset take ``REAL_MODEL_DEFAULTS`` (a built-in
        demo's: ``demo_defaults``)."""
        if self.actor.pretrain is None:
            fill_unset(self, demo_defaults(self.train.demo_model, distillation=self.demo_teacher))
            return self
        positions = model_positions(self.actor.pretrain)
        for path, value in REAL_MODEL_DEFAULTS.items():
            name, key = path.split(".")
            section = getattr(self, name)
            if key == "max_model_len" and positions is not None:
                value = min(value, positions)
            if key == "max_new_tokens":  # room for the prompt too
                value = min(value, max(1, self.rollout.max_model_len // 2))
            if key not in section.model_fields_set:
                setattr(self, name, section.model_copy(update={key: value}))
        return self

    @model_validator(mode="after")
    def _algorithm(self) -> PPOConfig:
        """The estimator, filters, corrections and penalties agree with the sampling settings."""
        est = ADVANTAGE_ESTIMATORS[self.algo.advantage.estimator]
        n = self.rollout.n_samples_per_prompt
        if est.group_shaping is not None and n < 2:
            raise ValueError(
                f"--algo.advantage.estimator {est.name} compares the samples of a prompt: it needs "
                f"--rollout.n_samples_per_prompt >= 2, got {n}"
            )
        if self.algo.dynamic_filtering.enable and n < 2:
            raise ValueError(
                f"--algo.dynamic_filtering.enable needs --rollout.n_samples_per_prompt >= 2, got {n}"
            )
        if est.uses_critic and self.critic.enable is False:
            raise ValueError(
                f"--algo.advantage.estimator {est.name} needs a critic, but --critic.enable is false"
            )
        if not est.uses_critic and self.critic.enable:
            raise ValueError(f"--critic.enable: the estimator {est.name} uses no critic (only gae does)")
        if self.algo.loss_agg != "token-mean" and self.train.packing:
            raise ValueError(
                f"--algo.loss_agg {self.algo.loss_agg} averages over sequences, but --train.packing puts "
                "several in one row: add --train.packing false"
            )
        if self.rollout.top_p < 1 and self.algo.is_correction.mode != "none":
            raise ValueError(
                "--algo.is_correction with --rollout.top_p < 1: the engine's log-probs are of the top-p truncated "
                "distribution, the learner's of the full one, so their ratio is no importance weight"
            )
        if not self.rollout.logprobs and self.algo.is_correction.mode != "none":
            raise ValueError(
                "--algo.is_correction needs the engines' log-probs, but --rollout.logprobs is false"
            )
        if not self.rollout.seed_per_sample and self.rollout.capabilities.seeded_calls:
            if self.train.async_.enabled:
                raise ValueError(
                    "--rollout.seed_per_sample false seeds each engine call, but --train.async.max_staleness "
                    "runs calls that overlap: keep it true"
                )
            if self.rollout.tensor_parallel_size > 1:
                raise ValueError(
                    "--rollout.seed_per_sample false seeds an engine's sampler in its own process, but "
                    "--rollout.tensor_parallel_size > 1 puts its workers in others: keep it true"
                )
        if self.algo.is_correction.low >= self.algo.is_correction.high:
            raise ValueError("--algo.is_correction.low must be below --algo.is_correction.high")
        if self.algo.dynamic_filtering.low >= self.algo.dynamic_filtering.high:
            raise ValueError("--algo.dynamic_filtering.low must be below --algo.dynamic_filtering.high")
        ob = self.algo.overlong.buffer_length
        if ob > self.rollout.max_new_tokens:
            raise ValueError(
                f"--algo.overlong.buffer_length {ob} exceeds --rollout.max_new_tokens {self.rollout.max_new_tokens}"
            )
        return self

    @model_validator(mode="after")
    def _asynchronous(self) -> PPOConfig:
        """Asynchronous training needs engines that serve weight updates while they generate."""
        if self.train.async_.enabled and self.colocated:
            raise ValueError(
                "--train.async.max_staleness with --train.colocate_*: colocated groups take turns on their "
                "devices, so generation cannot overlap training; choose one"
            )
        if self.train.async_.enabled and not self.rollout.capabilities.asynchronous:
            raise ValueError(
                f"--train.async.max_staleness {self.train.async_.max_staleness} needs a rollout backend with "
                f"asynchronous engines (vllm); --rollout.backend {self.rollout.backend} has none"
            )
        return self

    @model_validator(mode="after")
    def _batches(self) -> PPOConfig:
        """Each group's ranks get equal shards that the micro-batch size divides (the built-in demo's
        default: one micro-batch per rank, see ``TrainConfig.micro_batch_size``)."""
        check_learner_fields(self.learner, {"lr": "--actor.lr / --critic.lr"})
        demo = self.builtin_task and self.actor.pretrain is None
        if "micro_batch_size" not in self.train.model_fields_set:
            worlds = [self.actor.world_size] + ([self.critic.world_size] if self.uses_critic else [])
            shards = [self.optimizer_batch_size // data_parallel_size(w, self.learner) for w in worlds]
            train = self.train.model_copy()  # a TrainConfig passed in stays as it was
            train.micro_batch_size = fitting_micro_batch(shards, None if demo else train.micro_batch_size)
            self.train = train
        b = self.train.batch_size
        if b is not None and self.samples_per_step % b:
            raise ValueError(
                f"--train.batch_size {b} does not divide the {self.samples_per_step} samples of a rollout "
                "batch (--rollout.batch_size x --rollout.n_samples_per_prompt)"
            )
        what = "--train.batch_size" if b else "--rollout.batch_size x --rollout.n_samples_per_prompt"
        n, m = self.optimizer_batch_size, self.train.micro_batch_size
        check_split(n, what, self.actor.world_size, "actor", self.learner, m)
        if self.uses_critic:
            check_split(n, what, self.critic.world_size, "critic", self.learner, m)
        if self.uses_reference:
            check_split(n, what, self.ref.world_size, "reference", self.learner, None)
        if self.distills:
            check_split(n, what, self.teacher.world_size, "teacher", self.learner, None)
        for name, group in (("actor", self.actor), ("critic", self.critic)):
            try:
                group.lr_schedule(group.lr, self.total_optimizer_steps(name))
            except ValueError as err:
                raise ValueError(f"--{name}.{err}") from None
        return self

    @model_validator(mode="after")
    def _inputs(self) -> PPOConfig:
        """A model, data and exactly one reward source, in a combination that makes sense."""
        if self.actor.pretrain is None and self.data.path is not None:
            raise ValueError("--data.path is set but --actor.pretrain is not: give the model to train")
        if self.algo.advantage.estimator == "distill" and not self.distills:
            raise ValueError(
                "--algo.advantage.estimator distill: the teacher is its signal; give --teacher.pretrain "
                "(only the built-in demo, with no model given, trains its own)"
            )
        if (
            self.data.path is not None
            and self.rewarded
            and self.reward.source is None
            and not self.train.agent_func_path
        ):
            raise ValueError(
                "--data.path needs a reward: give --reward.func, --reward.pretrain, --reward.remote_url "
                "or --train.agent_func_path"
            )
        if self.train.agent_func_path is not None and self.reward.source is not None:
            flag = {"func": "func", "model": "pretrain", "remote": "remote_url"}[self.reward.source]
            raise ValueError(
                f"--train.agent_func_path and --reward.{flag}: the agent file is the reward source (its "
                "reward_func or its environment); give one of them"
            )
        if self.train.freeze_actor_steps and not self.uses_critic:
            raise ValueError(
                "--train.freeze_actor_steps trains the critic alone first: it needs one "
                "(--algo.advantage.estimator gae)"
            )
        if self.warmup_runs and self.uses_reference and self.ref.pretrain is None:
            raise ValueError(
                "--algo.kl.coef > 0 with the built-in warm-up: the reference would be the untrained model; "
                "set --train.warmup_sft_steps 0 or --ref.pretrain"
            )
        return self

    @model_validator(mode="after")
    def _parallelism(self) -> PPOConfig:
        """Parallelism options the groups and engines can run."""
        check_parallelism(self)
        return self

    @model_validator(mode="after")
    def _distillation(self) -> PPOConfig:
        """The teacher's flags, together and with a demo's defaults filled in."""
        check_distillation(self)
        return self
