"""Learner groups: the data-parallel ranks of one model as Ray actors around rlhf-learner.

Each rank is a :class:`LearnerWorker`; :class:`LearnerGroup` (in the driver) splits work over the ranks,
calls them together (DeepSpeed's collectives need every rank) and waits with a timeout.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from rlhf_learner import (
    DPOBatch,
    KTOBatch,
    LoraOptions,
    ModelOptions,
    PolicyBatch,
    RewardBatch,
    SFTBatch,
    StepResult,
    StrategyOptions,
    ValueBatch,
)

if TYPE_CHECKING:
    from rlhf_cli.placement import Plan

from rlhf_cli.batches import to_rows

__all__ = [
    "GroupSpec",
    "LearnerGroup",
    "LearnerWorker",
    "PolicyLossSettings",
    "Role",
    "launch_groups",
    "worker_env",
]

Role = Literal["actor", "critic", "ref", "reward"]


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """What one learner group runs."""

    role: Role
    model_path: str
    world_size: int
    strategy: StrategyOptions
    model: ModelOptions
    lora: LoraOptions | None = None
    temperature: float = 1.0
    """Sampling temperature: the actor and reference score tokens under the sampler's distribution."""
    trains: bool | None = None
    """Whether the group is trained; unset: the actor and critic are, the reference and reward model not."""

    @property
    def trained(self) -> bool:
        return self.trains if self.trains is not None else self.role in ("actor", "critic")


@dataclass(frozen=True, kw_only=True)
class PolicyLossSettings:
    """Everything the policy update needs besides the micro-batches."""

    clip_eps_low: float
    clip_eps_high: float | None
    dual_clip: float | None
    ratio_type: str
    entropy_coef: float
    loss_agg: str
    horizon: int
    kl_estimator: str
    kl_loss_coef: float
    """0: no KL loss term."""
    is_correction: str
    is_low: float
    is_high: float


class LearnerWorker:
    """One data-parallel rank of a learner group (a Ray actor). Methods are keyword-only."""

    def __init__(self, *, spec: GroupSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.engine: Any = None
        self.sender: Any = None
        self._sync_version = 0

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (for the group's rendezvous)."""
        import ray
        from rlhf_learner.strategy import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, *, master_addr: str, master_port: int) -> int:
        """Join the group's process group and build the model; returns the parameter count."""
        from rlhf_learner import (
            Actor,
            Strategy,
            apply_lora,
            load_causal_lm,
            load_critic,
            load_reference,
            load_reward_model,
        )

        spec = self.spec
        self.strategy = Strategy(spec.strategy)
        self.strategy.setup_distributed(
            rank=self.rank, world_size=spec.world_size, master_addr=master_addr, master_port=master_port
        )
        train = spec.trained
        ds_config = self.strategy.ds_config(train=train)
        if spec.role == "actor":
            lm = load_causal_lm(spec.model_path, options=spec.model, ds_config=ds_config)
            if spec.lora is not None:
                lm = apply_lora(lm, spec.lora)
            model: torch.nn.Module = Actor(lm, temperature=spec.temperature)
        elif spec.role == "ref":
            model = load_reference(
                spec.model_path, options=spec.model, ds_config=ds_config, temperature=spec.temperature
            )
        elif spec.role == "critic":
            model = load_critic(spec.model_path, options=spec.model, ds_config=ds_config)
        else:
            model = load_reward_model(spec.model_path, options=spec.model, ds_config=ds_config)
            if not train:
                model.eval()
                model.requires_grad_(False)
        self.engine = self.strategy.prepare(model, train=train)
        return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())

    # --- inference -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, *, sequences: list[torch.Tensor], micro_batch_size: int, packing: bool
    ) -> list[torch.Tensor]:
        """Per sequence: log-probs (actor, ref), state values (critic) as ``[T]``, or a score (reward)."""
        out: list[torch.Tensor] = []
        self.engine.eval()
        for lo in range(0, len(sequences), micro_batch_size):
            chunk = sequences[lo : lo + micro_batch_size]
            rows = to_rows([{"input_ids": s} for s in chunk], packing=packing and self.spec.role != "reward")
            t = {k: v.to(self.engine.device) for k, v in rows.tensors.items()}
            kw = {k: t[k] for k in ("attention_mask", "position_ids") if k in t}
            if self.spec.role in ("actor", "ref"):
                out += [x.float().cpu() for x in rows.split(self.engine(t["input_ids"], **kw).logp)]
            elif self.spec.role == "critic":
                out += [x.float().cpu() for x in rows.split(self.engine(t["input_ids"], **kw))]
            else:  # a reward model in training scores raw (its stored normalisation is for its users)
                scores = self.engine(t["input_ids"], **kw, normalize=False if self.spec.trained else None)
                out += list(scores.float().cpu())
        if self.spec.trained:
            self.engine.train()
        return out

    @torch.no_grad()
    def sequence_logps(
        self, *, sequences: list[torch.Tensor], masks: list[torch.Tensor], micro_batch_size: int
    ) -> list[float]:
        """Per sequence (a policy or reference): the summed log-probs of its ``masks`` tokens, from
        padded rows as the DPO / KTO steps lay them out."""
        logp = self.forward(sequences=sequences, micro_batch_size=micro_batch_size, packing=False)
        return [float((lp * m).sum()) for lp, m in zip(logp, masks, strict=True)]

    # --- updates ---------------------------------------------------------------------------------
    def train_policy(self, *, micro_batches: list[PolicyBatch], settings: PolicyLossSettings) -> StepResult:
        from rlhf_algos import aggregate_loss, approx_kl, policy_loss, vllm_is_weights
        from rlhf_learner import ppo_actor_step

        s = settings
        loss_fn = functools.partial(
            policy_loss,
            clip_eps_low=s.clip_eps_low,
            clip_eps_high=s.clip_eps_high,
            dual_clip=s.dual_clip,
            ratio_type=s.ratio_type,
        )
        is_fn = None
        if s.is_correction != "none":
            is_fn = functools.partial(vllm_is_weights, mode=s.is_correction, low=s.is_low, high=s.is_high)
        kl_fn = functools.partial(approx_kl, estimator=s.kl_estimator) if s.kl_loss_coef else None
        return ppo_actor_step(
            self.engine,
            micro_batches,
            policy_loss_fn=loss_fn,
            aggregate_fn=functools.partial(aggregate_loss, mode=s.loss_agg, horizon=s.horizon),
            kl_loss_fn=kl_fn,
            kl_coef=s.kl_loss_coef,
            entropy_coef=s.entropy_coef,
            is_weights_fn=is_fn,
        )

    def train_value(self, *, micro_batches: list[ValueBatch], clip_eps: float | None) -> StepResult:
        from rlhf_algos import aggregate_loss, value_loss
        from rlhf_learner import critic_step

        return critic_step(
            self.engine,
            micro_batches,
            value_loss_fn=functools.partial(value_loss, clip_eps=clip_eps),
            aggregate_fn=functools.partial(aggregate_loss, mode="token-mean"),
        )

    def train_sft(self, *, micro_batches: list[SFTBatch]) -> StepResult:
        from rlhf_algos import sft_loss
        from rlhf_learner import sft_step

        return sft_step(self.engine, micro_batches, sft_loss_fn=sft_loss)

    def train_reward_model(self, *, micro_batches: list[RewardBatch]) -> StepResult:
        from rlhf_algos import pairwise_rm_loss
        from rlhf_learner import reward_model_step

        return reward_model_step(self.engine, micro_batches, pair_loss_fn=pairwise_rm_loss)

    def train_dpo(
        self,
        *,
        micro_batches: list[DPOBatch],
        loss: str,
        beta: float,
        label_smoothing: float,
        nll_coef: float,
    ) -> StepResult:
        from rlhf_algos import dpo_loss
        from rlhf_learner import dpo_step

        fn = functools.partial(dpo_loss, beta=beta, variant=loss, label_smoothing=label_smoothing)
        return dpo_step(self.engine, micro_batches, dpo_loss_fn=fn, nll_coef=nll_coef)

    def train_kto(
        self,
        *,
        micro_batches: list[KTOBatch],
        beta: float,
        desirable_weight: float,
        undesirable_weight: float,
    ) -> StepResult:
        from rlhf_algos import kto_kl_baseline, kto_loss
        from rlhf_learner import kto_step

        fn = functools.partial(
            kto_loss, beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight
        )
        return kto_step(
            self.engine,
            micro_batches,
            kto_loss_fn=fn,
            kl_baseline_fn=kto_kl_baseline,
        )

    def set_reward_normalization(self, *, mean: float, std: float) -> None:
        """Store the score statistics in the reward model's config (saved with the export)."""
        self.engine.module.set_normalization(mean=mean, std=std)

    # --- weight sync (actor) ---------------------------------------------------------------------
    def open_weight_sync(
        self, *, transport: str, master_addr: str, master_port: int, world_size: int, timeout_s: float
    ) -> None:
        """Rank 0 hosts the sync group (blocks until every engine joined); other ranks only gather."""
        from rlhf_weightsync import DEFAULT_BUCKET_BYTES, WeightSender

        self.bucket_bytes = DEFAULT_BUCKET_BYTES[transport]
        if self.rank == 0:
            self.sender = WeightSender(
                transport=transport,  # type: ignore[arg-type]
                master_addr=master_addr,
                master_port=master_port,
                world_size=world_size,
                timeout_s=timeout_s,
                bucket_bytes=self.bucket_bytes,
            )

    def send_weights(self, *, version: int) -> dict | None:
        """Ship the current policy to every engine (ZeRO-3 shards gathered bucket by bucket; LoRA
        merged first). Collective over the group; rank 0 returns the sync's figures."""
        from rlhf_learner.strategy import unwrap_hf_model
        from rlhf_weightsync import gather_along

        hf = unwrap_hf_model(self.engine.module)
        if hasattr(hf, "peft_config"):  # ZeRO 0-2 (checked): every rank holds the weights; rank 0 merges
            if self.rank != 0:
                return None
            from rlhf_learner.lora import merged_state_dict

            state, _ = merged_state_dict(hf, self.strategy.full_state_dict(hf))
            named, gather = list(state.items()), None
        else:
            named, gather = list(hf.named_parameters()), self.strategy.gather
        if self.rank != 0:
            if gather is not None:
                gather_along(named, gather=gather, bucket_bytes=self.bucket_bytes)
            return None
        stats = self.sender.send(named, gather=gather, version=version)
        return {"version": stats.version, "seconds": stats.seconds, "bytes": stats.num_bytes}

    def close_weight_sync(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    # --- checkpoints -----------------------------------------------------------------------------
    def save(self, *, directory: str, tag: str) -> None:
        self.strategy.save_checkpoint(self.engine, directory, tag=tag)

    def load(self, *, directory: str, tag: str) -> None:
        self.strategy.load_checkpoint(self.engine, directory, tag=tag)

    def export(self, *, directory: str, tokenizer_path: str | None) -> None:
        tokenizer = None
        if tokenizer_path is not None and self.rank == 0:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.strategy.export_hf(self.engine.module, directory, tokenizer=tokenizer)

    def export_adapter(self, *, directory: str) -> bool:
        """Write the LoRA adapter alone (rank 0; ZeRO 0-2 keep whole weights on every rank). False
        when the model has no adapter."""
        from rlhf_learner import save_adapter
        from rlhf_learner.strategy import unwrap_hf_model

        hf = unwrap_hf_model(self.engine.module)
        if not hasattr(hf, "peft_config"):
            return False
        if self.rank == 0:
            save_adapter(hf, directory)
        return True


class LearnerGroup:
    """The driver's handle on one group's ranks."""

    def __init__(
        self,
        spec: GroupSpec,
        *,
        placement_group: Any,
        bundle_offset: int,
        num_cpus: float,
        num_gpus: float,
        timeout_s: float,
        env_vars: dict[str, str] | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.spec, self.timeout_s = spec, timeout_s
        cls = ray.remote(LearnerWorker)
        self.workers = [
            cls.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle_offset + r
                ),
                runtime_env={"env_vars": dict(env_vars or {})},
            ).remote(spec=spec, rank=r)
            for r in range(spec.world_size)
        ]
        self._pending: list[Any] = []

    # Calls are started on every rank at once; ``wait`` collects them with the group's timeout.
    def start_setup(self) -> None:
        addr, port = self._get(self.workers[0].node_address.remote())
        self._pending = [w.setup.remote(master_addr=addr, master_port=port) for w in self.workers]

    def wait_setup(self) -> int:
        counts = self._get(self._pending)
        self._pending = []
        return int(counts[0])

    def _get(self, refs: Any) -> Any:
        import ray

        return ray.get(refs, timeout=self.timeout_s)

    def shards(self, items: Sequence[Any]) -> list[list[Any]]:
        """``items`` cut into ``world_size`` contiguous shards (as equal as possible)."""
        n, k = len(items), len(self.workers)
        bounds = [n * r // k for r in range(k + 1)]
        return [list(items[bounds[r] : bounds[r + 1]]) for r in range(k)]

    def forward(
        self, sequences: Sequence[torch.Tensor], *, micro_batch_size: int, packing: bool
    ) -> list[torch.Tensor]:
        """Per-sequence results, each rank scoring its shard. Shards are padded (with copies of a
        sequence, results dropped) to the same length, so every rank makes the same number of forward
        calls: ZeRO-3 gathers parameters collectively in each one."""
        return self._sharded(
            "forward", sequences=sequences, micro_batch_size=micro_batch_size, packing=packing
        )

    def sequence_logps(
        self, sequences: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], *, micro_batch_size: int
    ) -> list[float]:
        """Per sequence: the summed log-probs of its ``masks`` tokens (see ``LearnerWorker``)."""
        return self._sharded(
            "sequence_logps", sequences=sequences, masks=masks, micro_batch_size=micro_batch_size
        )

    def _sharded(
        self, method: str, *, sequences: Sequence[Any], masks: Sequence[Any] = (), **kw: Any
    ) -> list[Any]:
        """``method`` on contiguous shards of ``sequences`` (and ``masks``), one per rank, results in order.
        Shards are padded (with copies of the first item, results dropped) to the same length, so every
        rank makes the same number of forward calls: ZeRO-3 gathers parameters collectively in each."""
        items = list(zip(sequences, masks, strict=True)) if masks else [(x, None) for x in sequences]
        shards = self.shards(items)
        longest = max(len(s) for s in shards)
        args = []
        for shard in shards:
            padded = shard + [items[0]] * (longest - len(shard))  # pairs stay together
            a: dict[str, Any] = {"sequences": [x for x, _ in padded]}
            if masks:
                a["masks"] = [m for _, m in padded]
            args.append(a)
        refs = [getattr(w, method).remote(**a, **kw) for w, a in zip(self.workers, args, strict=True)]
        parts = self._get(refs)
        return [x for part, shard in zip(parts, shards, strict=True) for x in part[: len(shard)]]

    # Update steps: rank ``r`` gets ``per_rank[r]``; every rank reports the same global result.
    def train_policy(
        self, per_rank: Sequence[list[PolicyBatch]], *, settings: PolicyLossSettings
    ) -> StepResult:
        return self._step("train_policy", per_rank, settings=settings)

    def train_value(self, per_rank: Sequence[list[ValueBatch]], *, clip_eps: float | None) -> StepResult:
        return self._step("train_value", per_rank, clip_eps=clip_eps)

    def train_sft(self, per_rank: Sequence[list[SFTBatch]]) -> StepResult:
        return self._step("train_sft", per_rank)

    def train_reward_model(self, per_rank: Sequence[list[RewardBatch]]) -> StepResult:
        return self._step("train_reward_model", per_rank)

    def train_dpo(
        self,
        per_rank: Sequence[list[DPOBatch]],
        *,
        loss: str,
        beta: float,
        label_smoothing: float,
        nll_coef: float,
    ) -> StepResult:
        return self._step(
            "train_dpo", per_rank, loss=loss, beta=beta, label_smoothing=label_smoothing, nll_coef=nll_coef
        )

    def train_kto(
        self,
        per_rank: Sequence[list[KTOBatch]],
        *,
        beta: float,
        desirable_weight: float,
        undesirable_weight: float,
    ) -> StepResult:
        return self._step(
            "train_kto",
            per_rank,
            beta=beta,
            desirable_weight=desirable_weight,
            undesirable_weight=undesirable_weight,
        )

    def _step(self, method: str, per_rank: Sequence[list[Any]], **kwargs: Any) -> StepResult:
        """Rank ``r`` runs ``method`` on ``per_rank[r]``; every rank reports the same global result."""
        refs = [
            getattr(w, method).remote(micro_batches=mbs, **kwargs)
            for w, mbs in zip(self.workers, per_rank, strict=True)
        ]
        return self._get(refs)[0]

    def set_reward_normalization(self, *, mean: float, std: float) -> None:
        self._get([w.set_reward_normalization.remote(mean=mean, std=std) for w in self.workers])

    def export_adapter(self, *, directory: str) -> bool:
        return bool(self._get([w.export_adapter.remote(directory=directory) for w in self.workers])[0])

    def start_weight_sync(
        self, *, transport: str, master_addr: str, master_port: int, world_size: int, timeout_s: float
    ) -> list[Any]:
        """Every rank joins (rank 0 hosts the sync group); refs to wait on once the engines joined."""
        return [
            w.open_weight_sync.remote(
                transport=transport,
                master_addr=master_addr,
                master_port=master_port,
                world_size=world_size,
                timeout_s=timeout_s,
            )
            for w in self.workers
        ]

    def start_send_weights(self, *, version: int) -> list[Any]:
        return [w.send_weights.remote(version=version) for w in self.workers]

    def close_weight_sync(self) -> None:
        self._get([w.close_weight_sync.remote() for w in self.workers])

    def save(self, *, directory: str, tag: str) -> None:
        self._get([w.save.remote(directory=directory, tag=tag) for w in self.workers])

    def load(self, *, directory: str, tag: str) -> None:
        self._get([w.load.remote(directory=directory, tag=tag) for w in self.workers])

    def export(self, *, directory: str, tokenizer_path: str | None) -> None:
        self._get([w.export.remote(directory=directory, tokenizer_path=tokenizer_path) for w in self.workers])

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []


def launch_groups(
    specs: dict[str, GroupSpec], plan: Plan, pgs: dict[str, Any], *, timeout_s: float
) -> dict[str, LearnerGroup]:
    """Create each group's ranks on its placement group (``plan``'s bundles) and start their set-up, all
    groups in parallel (``wait_setup`` collects them). A failure stops the groups already created."""
    groups: dict[str, LearnerGroup] = {}
    try:
        for name, spec in specs.items():
            bundle = plan.group(name).bundle
            groups[name] = LearnerGroup(
                spec,
                placement_group=pgs[name],
                bundle_offset=0,
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                timeout_s=timeout_s,
                env_vars=worker_env(),
            )
            groups[name].start_setup()
    except BaseException:
        for g in groups.values():
            g.shutdown()
        raise
    return groups


def worker_env() -> dict[str, str]:
    """Environment for learner ranks: this driver's thread settings where it has them."""
    keep = ("OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL")
    return {k: os.environ[k] for k in keep if k in os.environ}
