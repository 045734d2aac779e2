"""One data-parallel rank of a learner group, as a Ray actor around rlhf-learner. Every method is
keyword-only and typed: the driver calls them by name in code (``LearnerGroup``), never by string."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
from rlhf_learner import (
    DistillBatch,
    DPOBatch,
    KTOBatch,
    PolicyBatch,
    RewardBatch,
    SFTBatch,
    StepResult,
    ValueBatch,
)

from rlhf_cli.data.batches import TeacherTargets, distill_batch, to_rows
from rlhf_cli.data.images import ImageSequence, split_sequences
from rlhf_cli.runtime.learners import losses, tensor_wire
from rlhf_cli.runtime.learners.late_reference import LateReference, ref_logp_of
from rlhf_cli.runtime.learners.models import build_model
from rlhf_cli.runtime.learners.specs import (
    DistillSettings,
    DPOSettings,
    ExportOptions,
    GroupSpec,
    KTOSettings,
    PolicyLossSettings,
    RankLayout,
    ValueLossSettings,
)

__all__ = ["LearnerWorker"]


def _local_numel(p: torch.Tensor) -> int:
    """Elements this rank stores of ``p`` (an FSDP2 DTensor's own shard)."""
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


class LearnerWorker:
    """One data-parallel rank of a learner group (a Ray actor)."""

    def __init__(self, *, spec: GroupSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        tensor_wire.register()  # (its results: sequences' log-probs, values)
        if os.path.isdir(spec.cwd):  # a joined cluster's workers start elsewhere (see GroupSpec.cwd)
            os.chdir(spec.cwd)
        self.engine: Any = None
        self.sender: Any = None
        self._reserved: dict[int, socket.socket] = {}
        self._reference_parts: dict[Any, list[torch.Tensor]] = {}
        """The reference's results this rank fetched for the current rollout batch (train_policy)."""

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a port on it for a rendezvous this rank will serve (the group's, or the
        weight sync's): the port is held, listening, from now until that store takes it over."""
        import ray
        from rlhf_learner.strategy import reserve_port

        addr = ray.util.get_node_ip_address()
        for stale in self._reserved.values():  # a reservation is used by the call that follows it, or never
            stale.close()
        listener = reserve_port(addr)
        self._reserved = {listener.getsockname()[1]: listener}
        return addr, listener.getsockname()[1]

    def setup(self, *, master_addr: str, master_port: int) -> int:
        """Join the group's process group and build the model; returns the parameter count."""
        from rlhf_learner.strategy import make_strategy

        spec = self.spec
        if os.environ.get("RLHF_CPU_CORES"):  # the plan's cores (engines have the others)
            from rlhf_rollout.cores import allowed_cores  # the engines' order: whole physical cores apart

            allowed = allowed_cores()
            picked = {allowed[int(i) % len(allowed)] for i in os.environ["RLHF_CPU_CORES"].split(",")}
            os.sched_setaffinity(0, picked)
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # the plan's threads (Ray's default is 1)
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        self.strategy = make_strategy(spec.strategy)  # the backend --learner.backend names
        self.strategy.setup_distributed(
            rank=self.rank,
            world_size=spec.world_size,
            master_addr=master_addr,
            master_port=master_port,
            listener=self._reserved.pop(master_port, None),
        )
        sp_group = self.strategy.sequence_parallel_group if spec.role in ("actor", "ref") else None
        model = build_model(spec, self.strategy.loader_config(train=spec.trained), sp_group)
        self.engine = self.strategy.prepare(model, train=spec.trained)
        return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())

    def layout(self) -> RankLayout:
        """How this rank holds its model (see ``RankLayout``)."""
        from rlhf_learner.strategy import unwrap_hf_model

        o, hf = self.strategy.options, unwrap_hf_model(self.engine.module)
        return RankLayout(
            rank=self.rank,
            data_parallel_rank=self.strategy.data_parallel_rank,
            data_parallel_size=self.strategy.data_parallel_size,
            sequence_parallel_size=o.sequence_parallel_size,
            tensor_parallel_size=o.tensor_parallel_size,
            attention=str(getattr(hf.config, "_attn_implementation", "")),
            local_params=sum(_local_numel(p) for p in self.engine.module.parameters()),
        )

    # --- inference -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self, *, sequences: list[torch.Tensor | ImageSequence], micro_batch_size: int, packing: bool
    ) -> list[torch.Tensor]:
        """Per sequence: log-probs (actor, ref), state values (critic) as ``[T]``, or a score (reward).
        A sequence with images (actor, ref, critic) is scored from its ids and its images' pixels."""
        out: list[torch.Tensor] = []
        role = self.spec.role
        self.engine.eval()
        for lo in range(0, len(sequences), micro_batch_size):
            ids, images = split_sequences(sequences[lo : lo + micro_batch_size])
            rows = to_rows(
                [{"input_ids": s} for s in ids], packing=packing and role != "reward", images=images
            )
            t = {k: v.to(self.engine.device) for k, v in rows.tensors.items()}
            kw = {k: v for k, v in t.items() if k != "input_ids"}
            if "pixel_values" in kw and role == "reward":
                raise ValueError(
                    "the reward model reads text only, but these sequences hold images (an environment "
                    "showed them); use a reward function"
                )
            if role in ("actor", "ref"):
                out += [x.float().cpu() for x in rows.split(self.engine(t["input_ids"], **kw).logp)]
            elif role == "critic":
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

    @torch.no_grad()
    def teacher_targets(
        self,
        *,
        sequences: list[torch.Tensor | ImageSequence],
        masks: list[torch.Tensor],
        micro_batch_size: int,
        top_k: int | None,
        vocab: int | None,
        token_logp: bool = False,
    ) -> list[TeacherTargets]:
        """Per sequence (a teacher): its next-token distribution at each ``masks`` token, the ``top_k``
        most likely tokens (None: all ``vocab`` of the student's); with ``token_logp`` also the log-probs
        of the sequence's own tokens (on-policy distillation)."""
        from rlhf_learner import top_tokens

        self.engine.eval()
        out: list[TeacherTargets] = []
        for lo in range(0, len(sequences), micro_batch_size):
            ms = masks[lo : lo + micro_batch_size]
            ids, images = split_sequences(sequences[lo : lo + micro_batch_size])
            seqs = [{"input_ids": s, "loss_mask": m} for s, m in zip(ids, ms, strict=True)]
            rows = to_rows(seqs, packing=False, images=images)  # row i is sequence i: targets in its order
            t = {k: v.to(self.engine.device) for k, v in rows.tensors.items()}
            mask = t.pop("loss_mask")
            res = self.engine(t.pop("input_ids"), **t, vocab_logp_at=mask)
            logp, top = top_tokens(res.vocab_logp, top_k=top_k, vocab=vocab)
            counts = [int(m.bool().sum()) for m in ms]
            own = rows.split(res.logp) if token_logp else [None] * len(ms)
            for lp, ix, o in zip(logp.split(counts), top.split(counts), own, strict=True):
                kept = None if o is None else o.float().cpu()
                out.append(
                    TeacherTargets(logp=lp.float().cpu(), ids=ix.to(torch.int32).cpu(), token_logp=kept)
                )
        return out

    @torch.no_grad()
    def distill_divergences(
        self,
        *,
        sequences: list[torch.Tensor],
        masks: list[tuple[torch.Tensor, TeacherTargets]],
        micro_batch_size: int,
        settings: DistillSettings,
    ) -> list[tuple[float, int]]:
        """Per sequence (a student): the summed divergence from its teacher targets over its ``masks``
        tokens, and their count."""
        from rlhf_learner import distill_divergences

        fn = losses.distill_divergence_fn(settings)
        self.engine.eval()
        out: list[tuple[float, int]] = []
        for lo in range(0, len(sequences), micro_batch_size):
            part, ss = masks[lo : lo + micro_batch_size], sequences[lo : lo + micro_batch_size]
            batch, rows = distill_batch(ss, [m for m, _ in part], [t for _, t in part], packing=True)
            mb = batch.to(self.engine.device)
            div, _ = distill_divergences(self.engine, mb, divergence_fn=fn)
            per_token = torch.zeros(batch.loss_mask.shape)
            per_token[batch.loss_mask.bool()] = div.float().cpu()
            out += [
                (float(x.sum()), int(m.bool().sum()))
                for x, (m, _) in zip(rows.split(per_token), part, strict=True)
            ]
        if self.spec.trained:
            self.engine.train()
        return out

    # --- updates ---------------------------------------------------------------------------------
    def train_policy(
        self,
        *,
        micro_batches: list[PolicyBatch],
        settings: PolicyLossSettings,
        late_reference: LateReference | None = None,
    ) -> StepResult:
        """``late_reference``: the micro-batches carry no reference log-probs; fetch them from the
        reference group's results once the first forward has run (:mod:`rlhf_cli.runtime.learners.late_reference`)."""
        from rlhf_learner import ppo_actor_step

        kw = losses.policy_step_args(settings)
        if late_reference is not None:  # (the results of this rollout batch's reference forward only)
            kept = self._reference_parts.items()
            self._reference_parts = {r: v for r, v in kept if r in late_reference.parts}
            shapes = [mb.input_ids.shape for mb in micro_batches]
            kw["ref_logp_of"] = ref_logp_of(late_reference, shapes, self._reference_parts)
        return ppo_actor_step(self.engine, micro_batches, **kw)

    def train_value(self, *, micro_batches: list[ValueBatch], settings: ValueLossSettings) -> StepResult:
        from rlhf_learner import critic_step

        return critic_step(self.engine, micro_batches, **losses.value_step_args(settings))

    def train_sft(self, *, micro_batches: list[SFTBatch]) -> StepResult:
        from rlhf_algos import sft_loss
        from rlhf_learner import sft_step

        return sft_step(self.engine, micro_batches, sft_loss_fn=sft_loss)

    def train_reward_model(self, *, micro_batches: list[RewardBatch]) -> StepResult:
        from rlhf_algos import pairwise_rm_loss
        from rlhf_learner import reward_model_step

        return reward_model_step(self.engine, micro_batches, pair_loss_fn=pairwise_rm_loss)

    def train_dpo(self, *, micro_batches: list[DPOBatch], settings: DPOSettings) -> StepResult:
        from rlhf_learner import dpo_step

        return dpo_step(self.engine, micro_batches, **losses.dpo_step_args(settings))

    def train_kto(self, *, micro_batches: list[KTOBatch], settings: KTOSettings) -> StepResult:
        from rlhf_learner import kto_step

        return kto_step(self.engine, micro_batches, **losses.kto_step_args(settings))

    def train_distill(self, *, micro_batches: list[DistillBatch], settings: DistillSettings) -> StepResult:
        from rlhf_learner import distill_step

        return distill_step(self.engine, micro_batches, divergence_fn=losses.distill_divergence_fn(settings))

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
                listener=self._reserved.pop(master_port, None),
            )

    def send_weights(self, version: int, with_frozen_tower: bool = False) -> Any:
        """Ship the current policy to every engine (ZeRO-3 shards gathered bucket by bucket; LoRA
        merged first: with QLoRA each 4-bit base weight is dequantized on rank 0's GPU, the delta added,
        and everything sent in the compute dtype, bf16; a frozen vision tower is not sent, the engines
        hold it from the checkpoint, unless ``with_frozen_tower``: engines that drop their weights asleep).
        Collective over the group; rank 0 returns the sender's ``SyncStats``, the other ranks None."""
        from rlhf_learner.models import trained_parameters
        from rlhf_learner.strategy import unwrap_hf_model
        from rlhf_weightsync import gather_along

        hf = unwrap_hf_model(self.engine.module)
        if hasattr(hf, "peft_config"):  # every rank takes part in the gathers (fsdp2); rank 0 merges
            state = self.strategy.full_state_dict(hf, rank0_only=True)
            if self.rank != 0:
                return None
            from rlhf_learner.lora import merged_state_dict

            state, _ = merged_state_dict(hf, state)
            named, gather = list(state.items()), None
        else:
            from rlhf_learner.strategy import mark_full_shapes

            mark_full_shapes(hf)  # tensor-parallel shards: their whole shapes (a gather, the first time)
            named, gather = trained_parameters(hf, with_frozen_tower=with_frozen_tower), self.strategy.gather
        # in the compute dtype: an fsdp2 group keeps fp32 shards under bf16 mixed precision (half the bytes)
        wire = torch.bfloat16 if self.strategy.options.precision == "bf16" else None
        if self.rank != 0:
            if gather is not None:
                gather_along(named, gather=gather, bucket_bytes=self.bucket_bytes, dtype=wire)
            return None
        return self.sender.send(named, gather=gather, version=version, dtype=wire)

    def offload_states(self) -> str:
        """The engine's states to host memory while colocated rollout engines use the GPU (or why not)."""
        return self.strategy.offload_states(self.engine)

    def reload_states(self) -> str:
        return self.strategy.reload_states(self.engine)

    def close_weight_sync(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    # --- checkpoints and export ------------------------------------------------------------------
    def save(self, *, directory: str, tag: str) -> None:
        self.strategy.save_checkpoint(self.engine, directory, tag=tag)

    def load(self, *, directory: str, tag: str) -> None:
        self.strategy.load_checkpoint(self.engine, directory, tag=tag)

    def export(self, *, directory: str, tokenizer_path: str | None, options: ExportOptions) -> None:
        """A Hugging Face folder (collective under ZeRO-3; rank 0 alone writes), sharded and cast as
        ``options`` say."""
        tokenizer = None
        if tokenizer_path is not None and self.rank == 0:  # a vision-language model: its whole processor
            from rlhf_learner.models import is_vision_language
            from transformers import AutoProcessor, AutoTokenizer

            vision = is_vision_language(getattr(self.engine.module, "config", None))
            tokenizer = (AutoProcessor if vision else AutoTokenizer).from_pretrained(tokenizer_path)
        self.strategy.export_hf(
            self.engine.module,
            directory,
            tokenizer=tokenizer,
            dtype=options.torch_dtype,
            max_shard_bytes=options.max_shard_bytes,
        )

    def export_adapter(self, *, directory: str) -> bool:
        """Write the LoRA adapter alone: every rank takes part in the gathers (a sharded backend's), rank 0
        writes. False when the model has no adapter."""
        from rlhf_learner import save_adapter
        from rlhf_learner.strategy import unwrap_hf_model

        hf = unwrap_hf_model(self.engine.module)
        if not hasattr(hf, "peft_config"):
            return False
        state = self.strategy.full_state_dict(hf, rank0_only=True)
        if self.rank == 0:
            save_adapter(hf, directory, state_dict=state)
        return True
