"""OpenRLHF's flag names (its ``train_ppo_ray``, ``train_sft``, ``train_rm``, ``train_dpo`` and ``train_kto``
scripts) and this CLI's flag for each, so that an unknown flag that is one of them is answered with its
name here. Several candidates: the first one the command has (``--max_epochs``: ``--train.ppo_epochs`` in
``rlhf ppo``, ``--train.num_epochs`` in the offline commands)."""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["OPENRLHF_FLAGS", "OPENRLHF_NOTES", "openrlhf_hint"]

_GROUPS = ("actor", "critic", "ref", "reward")

OPENRLHF_FLAGS: dict[str, tuple[str, ...]] = {
    # models and where they run
    "pretrain": ("actor.pretrain", "model.pretrain"),
    "reward_pretrain": ("reward.pretrain",),
    "critic_pretrain": ("critic.pretrain",),
    "ref_pretrain": ("ref.pretrain",),
    "remote_rm_url": ("reward.remote_url",),
    "agent_func_path": ("train.agent_func_path",),
    **{f"{g}_num_nodes": (f"{g}.num_nodes",) for g in _GROUPS},
    **{f"{g}_num_gpus_per_node": (f"{g}.num_devices_per_node",) for g in _GROUPS},
    "colocate_all_models": ("train.colocate_all",),
    "colocate_actor_ref": ("train.colocate_actor_ref",),
    "colocate_critic_reward": ("train.colocate_critic_reward",),
    "deepspeed_enable_sleep": ("train.offload_during_rollout",),
    "async_train": ("train.async.max_staleness",),
    # vLLM and weight sync
    "vllm_num_engines": ("rollout.num_engines",),
    "vllm_tensor_parallel_size": ("rollout.tensor_parallel_size",),
    "vllm_gpu_memory_utilization": ("rollout.gpu_memory_utilization",),
    "vllm_enable_sleep": ("vllm.sleep_level",),
    "vllm_sync_backend": ("weightsync.transport",),
    "enable_prefix_caching": ("vllm.enable_prefix_caching",),
    "enforce_eager": ("vllm.enforce_eager",),
    # sampling and batches
    "rollout_batch_size": ("rollout.batch_size",),
    "n_samples_per_prompt": ("rollout.n_samples_per_prompt",),
    "generate_max_len": ("rollout.max_new_tokens",),
    "prompt_max_len": ("rollout.max_model_len",),
    "max_len": ("rollout.max_model_len", "data.max_len"),
    "temperature": ("rollout.temperature",),
    "top_p": ("rollout.top_p",),
    "train_batch_size": ("train.batch_size",),
    "micro_train_batch_size": ("train.micro_batch_size",),
    "max_epochs": ("train.ppo_epochs", "train.num_epochs"),
    "num_episodes": ("train.num_steps",),
    "freezing_actor_steps": ("train.freeze_actor_steps",),
    "seed": ("train.seed",),
    "packing_samples": ("train.packing",),
    "use_dynamic_batch": ("train.dynamic_batch",),
    # the algorithm
    "advantage_estimator": ("algo.advantage.estimator",),
    "gamma": ("algo.advantage.gamma",),
    "lambd": ("algo.advantage.lam",),
    "reward_clip_range": ("algo.advantage.reward_clip",),
    "init_kl_coef": ("algo.kl.coef",),
    "kl_estimator": ("algo.kl.estimator",),
    "use_kl_loss": ("algo.kl.use_loss",),
    "kl_target": ("algo.kl.target",),
    "kl_horizon": ("algo.kl.horizon",),
    "eps_clip": ("algo.clip.eps_low",),
    "eps_clip_low_high": ("algo.clip.eps_low",),
    "dual_clip": ("algo.clip.dual_clip",),
    "value_clip": ("algo.clip.value_eps",),
    "policy_loss_type": ("algo.clip.ratio_type",),
    "entropy_loss_coef": ("algo.entropy_coef",),
    "aux_loss_coef": ("actor.aux_loss_coef",),
    "overlong_buffer_len": ("algo.overlong.buffer_length",),
    "overlong_penalty_factor": ("algo.overlong.penalty_factor",),
    "dynamic_filtering": ("algo.dynamic_filtering.enable",),
    "dynamic_filtering_reward_range": ("algo.dynamic_filtering.low",),
    "beta": ("algo.beta",),
    "label_smoothing": ("algo.label_smoothing",),
    "nll_loss_coef": ("algo.nll_coef",),
    "ipo": ("algo.loss",),
    "desirable_loss_weight": ("algo.desirable_weight",),
    "undesirable_loss_weight": ("algo.undesirable_weight",),
    # optimisation
    "actor_learning_rate": ("actor.lr",),
    "critic_learning_rate": ("critic.lr",),
    "learning_rate": ("model.lr", "actor.lr"),
    "lr_scheduler": ("actor.lr_scheduler", "model.lr_scheduler"),
    "lr_warmup_ratio": ("actor.lr_warmup_ratio", "model.lr_warmup_ratio"),
    "max_norm": ("learner.grad_clip",),
    "l2": ("learner.weight_decay",),
    "adam_betas": ("learner.betas",),
    "zero_stage": ("learner.zero_stage",),
    "bf16": ("learner.precision",),
    "adam_offload": ("learner.offload_optimizer",),
    "ds_tensor_parallel_size": ("learner.tensor_parallel_size",),
    "ring_attn_size": ("learner.sequence_parallel_size",),
    "gradient_checkpointing": ("actor.model.gradient_checkpointing", "model.options.gradient_checkpointing"),
    "flash_attn": ("actor.model.attn_implementation", "model.options.attn_implementation"),
    "use_liger_kernel": ("actor.model.liger", "model.options.liger"),
    "load_in_4bit": ("actor.lora.load_in_4bit", "lora.load_in_4bit"),
    "lora_rank": ("actor.lora.rank", "lora.rank"),
    "lora_alpha": ("actor.lora.alpha", "lora.alpha"),
    "lora_dropout": ("actor.lora.dropout", "lora.dropout"),
    "target_modules": ("actor.lora.target_modules", "lora.target_modules"),
    # data
    "prompt_data": ("data.path",),
    "dataset": ("data.path",),
    "input_key": ("data.input_key",),
    "output_key": ("data.response_key",),
    "chosen_key": ("data.chosen_key",),
    "rejected_key": ("data.rejected_key",),
    "label_key": ("data.label_key",),
    "apply_chat_template": ("data.apply_chat_template",),
    "input_template": ("data.input_template",),
    "max_samples": ("data.max_samples",),
    "eval_dataset": ("eval.path",),
    "eval_temperature": ("eval.temperature",),
    "eval_n_samples_per_prompt": ("eval.n_samples",),
    # checkpoints and logs
    "eval_steps": ("eval.every",),
    "save_steps": ("ckpt.save_steps",),
    "load_checkpoint": ("ckpt.load_enable",),
    "max_ckpt_num": ("ckpt.max_keep",),
    "save_path": ("logger.run_dir",),
    "ckpt_path": ("logger.run_dir",),
    "use_tensorboard": ("logger.tensorboard",),
    "use_wandb": ("logger.wandb_project",),
    "wandb_project": ("logger.wandb_project",),
}
"""OpenRLHF flag (without ``--``) -> this CLI's candidates, in order of preference."""


OPENRLHF_NOTES: dict[str, str] = {
    "num_episodes": "training steps, not passes over the prompts",
    "prompt_max_len": "prompt + response",
    "max_len": "prompt + response",
    "use_wandb": "the project; the API key goes in WANDB_API_KEY",
    "bf16": "bf16 or fp32",
    "flash_attn": "flash_attention_2",
    "eps_clip": "and --algo.clip.eps_high",
    "async_train": "the staleness bound, e.g. 1",
    "vllm_enable_sleep": "the level, 1 or 2",
}
"""What differs in meaning or value, said after the name."""


def openrlhf_hint(name: str, valid: Collection[str]) -> str | None:
    """``"; OpenRLHF's --{name} is --{ours} here"`` (and what differs, ``OPENRLHF_NOTES``) for an OpenRLHF
    flag whose counterpart the command has (``valid``: its dotted flags), else None."""
    ours = next((c for c in OPENRLHF_FLAGS.get(name, ()) if c in valid), None)
    note = f" ({OPENRLHF_NOTES[name]})" if name in OPENRLHF_NOTES else ""
    return f"; OpenRLHF's --{name} is --{ours} here{note}" if ours else None
