"""Learner groups in the driver: the data-parallel ranks of one model (``LearnerWorker`` actors).

``LearnerGroup`` splits work over the ranks, starts the same typed call on every rank at once
(DeepSpeed's collectives need every rank) and waits with the group's timeout. The stages see it
through the small Protocols of ``rlhf_cli.runtime.learners.protocols``.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

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

from rlhf_cli.data.batches import TeacherTargets
from rlhf_cli.data.images import ImageSequence
from rlhf_cli.runtime.host.malloc import MALLOC_SETTINGS, malloc_env
from rlhf_cli.runtime.host.openmp import openmp_env
from rlhf_cli.runtime.learners.late_reference import LateReference, PendingScores
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
from rlhf_cli.runtime.learners.worker import LearnerWorker
from rlhf_cli.runtime.runs.failures import Stops, get_all, raise_a_death_among

if TYPE_CHECKING:
    from rlhf_cli.runtime.plan.cluster import PlacementGroups
    from rlhf_cli.runtime.plan.placement import GroupPlan, Plan

__all__ = ["LearnerGroup", "launch_groups", "worker_env"]

T = TypeVar("T")
Call = Callable[[Any, dict[str, Any]], Any]
"""``(worker, kwargs) -> ObjectRef``: one typed remote call, e.g. ``lambda w, a: w.forward.remote(**a)``."""


class LearnerGroup:
    """The driver's handle on one group's ranks."""

    def __init__(
        self,
        spec: GroupSpec,
        *,
        placement_group: Any,
        bundle_index: Callable[[int], int] = lambda rank: rank,
        num_cpus: float,
        num_gpus: float,
        timeout_s: float,
        env_vars: dict[str, str] | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.spec, self.timeout_s = spec, timeout_s
        self.submitting = threading.Lock()
        """Held while a call is submitted to every rank: calls from two threads (the trainer's, an engine's
        replacement) reach every rank in the same order, so their collectives do too."""
        cls = ray.remote(LearnerWorker)
        self.workers = [
            cls.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle_index(r)
                ),
                runtime_env={"env_vars": dict(env_vars or {})},
            ).remote(spec=spec, rank=r)
            for r in range(spec.world_size)
        ]
        self._pending: list[Any] = []

    # Set-up is started on every rank at once; ``wait_setup`` collects it with the group's timeout.
    def start_setup(self, master: tuple[str, int]) -> None:
        """``master``: rank 0's ``node_address`` (the group's rendezvous)."""
        addr, port = master
        self._pending = [w.setup.remote(master_addr=addr, master_port=port) for w in self.workers]

    def wait_setup(self) -> int:
        counts = self._get(self._pending)
        self._pending = []
        return int(counts[0])

    def _get(self, refs: Any) -> Any:
        """Every rank's result; a rank's failure (or death) is raised at once."""
        if isinstance(refs, list):
            return get_all(refs, timeout_s=self.timeout_s)
        return get_all([refs], timeout_s=self.timeout_s)[0]

    def actor_names(self, name: str) -> dict[str, str]:
        """Each rank's Ray actor id -> ``"the {name} group's rank {r}"``."""
        return {w._actor_id.hex(): f"the {name} group's rank {r}" for r, w in enumerate(self.workers)}

    def _all(self, call: Callable[[Any], Any]) -> list[Any]:
        """``call(worker)`` on every rank at once; every rank's result, in rank order."""
        with self.submitting:
            refs = [call(w) for w in self.workers]
        return self._get(refs)

    @property
    def block(self) -> int:
        """Ranks that share one data shard: ``sequence_parallel_size x tensor_parallel_size`` consecutive
        ranks split each sequence (ring attention) or each weight matrix (AutoTP) between them."""
        o = self.spec.strategy
        return o.sequence_parallel_size * o.tensor_parallel_size

    def shards(self, items: Sequence[T]) -> list[list[T]]:
        """``items`` cut into one contiguous shard per data-parallel rank (as equal as possible), repeated
        for each rank of a block: the list has one entry per rank."""
        n, k = len(items), len(self.workers) // self.block
        bounds = [n * d // k for d in range(k + 1)]
        return [
            list(items[bounds[r // self.block] : bounds[r // self.block + 1]])
            for r in range(len(self.workers))
        ]

    def layouts(self) -> list[RankLayout]:
        """How each rank holds its model, in rank order."""
        return self._all(lambda w: w.layout.remote())

    # --- inference -------------------------------------------------------------------------------
    def forward(
        self, sequences: Sequence[torch.Tensor], *, micro_batch_size: int, packing: bool
    ) -> list[torch.Tensor]:
        """Per-sequence results (see ``LearnerWorker.forward``), each rank scoring its shard."""
        return self.submit_forward(sequences, micro_batch_size=micro_batch_size, packing=packing)()

    def submit_forward(
        self, sequences: Sequence[torch.Tensor], *, micro_batch_size: int, packing: bool
    ) -> Callable[[], list[torch.Tensor]]:
        """Start ``forward`` on every rank and return a call that waits for its results (so forwards of
        groups on different devices overlap)."""
        return self._submit(
            lambda w, a: w.forward.remote(**a, micro_batch_size=micro_batch_size, packing=packing),
            sequences=sequences,
        )

    def start_forward(
        self, sequences: Sequence[torch.Tensor], *, micro_batch_size: int, packing: bool
    ) -> PendingScores:
        """Start ``forward`` on every rank and wait for nothing: its results stay in Ray's object store,
        for the ranks of another group to fetch (:mod:`rlhf_cli.runtime.learners.late_reference`)."""
        call = lambda w, a: w.forward.remote(**a, micro_batch_size=micro_batch_size, packing=packing)  # noqa: E731
        return self._start(call, sequences=sequences)

    def sequence_logps(
        self, sequences: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], *, micro_batch_size: int
    ) -> list[float]:
        """Per sequence: the summed log-probs of its ``masks`` tokens (see ``LearnerWorker``)."""
        return self._sharded(
            lambda w, a: w.sequence_logps.remote(**a, micro_batch_size=micro_batch_size),
            sequences=sequences,
            masks=masks,
        )

    def submit_teacher_targets(
        self,
        sequences: Sequence[torch.Tensor | ImageSequence],
        masks: Sequence[torch.Tensor],
        *,
        micro_batch_size: int,
        top_k: int | None,
        vocab: int | None,
        token_logp: bool = False,
    ) -> Callable[[], list[TeacherTargets]]:
        """Start, per sequence (a teacher), its distributions at the ``masks`` tokens (see
        ``LearnerWorker.teacher_targets``); the returned call waits for them."""
        return self._submit(
            lambda w, a: w.teacher_targets.remote(
                **a, micro_batch_size=micro_batch_size, top_k=top_k, vocab=vocab, token_logp=token_logp
            ),
            sequences=sequences,
            masks=masks,
        )

    def distill_divergences(
        self,
        sequences: Sequence[torch.Tensor],
        targets: Sequence[tuple[torch.Tensor, TeacherTargets]],
        *,
        micro_batch_size: int,
        settings: DistillSettings,
    ) -> list[tuple[float, int]]:
        """Per sequence (a student): its summed divergence from ``targets`` and the token count."""
        return self._sharded(
            lambda w, a: w.distill_divergences.remote(
                **a, micro_batch_size=micro_batch_size, settings=settings
            ),
            sequences=sequences,
            masks=targets,
        )

    def _sharded(self, call: Call, *, sequences: Sequence[Any], masks: Sequence[Any] = ()) -> list[Any]:
        return self._submit(call, sequences=sequences, masks=masks)()

    def _submit(
        self, call: Call, *, sequences: Sequence[Any], masks: Sequence[Any] = ()
    ) -> Callable[[], list[Any]]:
        """:meth:`_start`; the returned call waits and gives the results in order."""
        pending = self._start(call, sequences=sequences, masks=masks)

        def results() -> list[Any]:
            parts = self._get(pending.all_refs)[:: self.block]  # a block's ranks return the same results
            return [x for part, n in zip(parts, pending.lengths, strict=True) for x in part[:n]]

        return results

    def _start(self, call: Call, *, sequences: Sequence[Any], masks: Sequence[Any] = ()) -> PendingScores:
        """``call`` on contiguous shards of ``sequences`` (and ``masks``), one per rank, not waited for.
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
        with self.submitting:
            refs = [call(w, a) for w, a in zip(self.workers, args, strict=True)]
        return PendingScores(
            parts=refs[:: self.block],
            lengths=[len(s) for s in shards[:: self.block]],
            all_refs=refs,
            timeout_s=self.timeout_s,
        )

    # --- updates: rank ``r`` gets ``per_rank[r]``; every rank reports the same global result ---------
    def _step(self, per_rank: Sequence[list[Any]], call: Call) -> StepResult:
        with self.submitting:
            refs = [call(w, {"micro_batches": mbs}) for w, mbs in zip(self.workers, per_rank, strict=True)]
        return self._get(refs)[0]

    def train_policy(
        self,
        per_rank: Sequence[list[PolicyBatch]],
        *,
        settings: PolicyLossSettings,
        reference: tuple[PendingScores, Sequence[LateReference]] | None = None,
    ) -> StepResult:
        """``reference``: the reference group's forward, still running, and what each rank needs to fetch
        its micro-batches' log-probs from it (they carry none; the ranks wait for it). When the update
        fails because a reference rank died, that death is what is raised."""
        if reference is None:
            return self._step(per_rank, lambda w, a: w.train_policy.remote(**a, settings=settings))
        pending, late = reference
        with self.submitting:
            refs = [
                w.train_policy.remote(micro_batches=mbs, settings=settings, late_reference=lr)
                for w, mbs, lr in zip(self.workers, per_rank, late, strict=True)
            ]
        try:
            return self._get(refs)[0]
        except Exception as err:
            raise_a_death_among(pending.all_refs, within_s=2.0, cause=err)
            raise

    def train_value(self, per_rank: Sequence[list[ValueBatch]], *, settings: ValueLossSettings) -> StepResult:
        return self._step(per_rank, lambda w, a: w.train_value.remote(**a, settings=settings))

    def train_sft(self, per_rank: Sequence[list[SFTBatch]]) -> StepResult:
        return self._step(per_rank, lambda w, a: w.train_sft.remote(**a))

    def train_reward_model(self, per_rank: Sequence[list[RewardBatch]]) -> StepResult:
        return self._step(per_rank, lambda w, a: w.train_reward_model.remote(**a))

    def train_dpo(self, per_rank: Sequence[list[DPOBatch]], *, settings: DPOSettings) -> StepResult:
        return self._step(per_rank, lambda w, a: w.train_dpo.remote(**a, settings=settings))

    def train_kto(self, per_rank: Sequence[list[KTOBatch]], *, settings: KTOSettings) -> StepResult:
        return self._step(per_rank, lambda w, a: w.train_kto.remote(**a, settings=settings))

    def train_distill(
        self, per_rank: Sequence[list[DistillBatch]], *, settings: DistillSettings
    ) -> StepResult:
        return self._step(per_rank, lambda w, a: w.train_distill.remote(**a, settings=settings))

    def set_reward_normalization(self, *, mean: float, std: float) -> None:
        self._all(lambda w: w.set_reward_normalization.remote(mean=mean, std=std))

    # --- weight sync: refs, so the engines' side can be awaited together ------------------------------
    def start_weight_sync(
        self, *, transport: str, master_addr: str, master_port: int, world_size: int, timeout_s: float
    ) -> list[Any]:
        """Every rank joins (rank 0 hosts the sync group); refs to wait on once the engines joined."""
        kw = dict(
            master_addr=master_addr, master_port=master_port, world_size=world_size, timeout_s=timeout_s
        )
        with self.submitting:
            return [w.open_weight_sync.remote(transport=transport, **kw) for w in self.workers]

    def start_send_weights(self, *, version: int, with_frozen_tower: bool = False) -> list[Any]:
        """Refs of every rank's ``send_weights``; rank 0's resolves to the sender's ``SyncStats``."""
        with self.submitting:
            return [w.send_weights.remote(version, with_frozen_tower) for w in self.workers]

    def close_weight_sync(self) -> None:
        self._all(lambda w: w.close_weight_sync.remote())

    # --- memory, when colocated with rollout engines ------------------------------------------------
    def offload_states(self) -> list[str]:
        """Every rank's states to host memory; each rank's report (what it did or why not)."""
        return self._all(lambda w: w.offload_states.remote())

    def reload_states(self) -> list[str]:
        return self._all(lambda w: w.reload_states.remote())

    # --- checkpoints and export --------------------------------------------------------------------
    def save(self, *, directory: str, tag: str) -> None:
        self._all(lambda w: w.save.remote(directory=directory, tag=tag))

    def load(self, *, directory: str, tag: str) -> None:
        self._all(lambda w: w.load.remote(directory=directory, tag=tag))

    def export(self, *, directory: str, tokenizer_path: str | None, options: ExportOptions) -> None:
        self._all(
            lambda w: w.export.remote(directory=directory, tokenizer_path=tokenizer_path, options=options)
        )

    def export_adapter(self, *, directory: str) -> bool:
        return bool(self._all(lambda w: w.export_adapter.remote(directory=directory))[0])

    def shutdown(self) -> None:
        """Kill the ranks (idempotent)."""
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []


def launch_groups(
    specs: dict[str, GroupSpec],
    plan: Plan,
    pgs: PlacementGroups,
    *,
    timeout_s: float,
    stop_at_exit: Stops,
) -> dict[str, LearnerGroup]:
    """Create every group's ranks on its placement group, then start their set-up once each group's rank 0
    has said where it listens (``wait_setup`` collects the set-up): the groups start in parallel, and
    other work overlaps them. Each group's stop is registered with ``stop_at_exit`` the moment it is
    created."""
    groups: dict[str, LearnerGroup] = {}
    for name, spec in specs.items():
        bundle = plan.group(name).bundle
        threads, cores = plan.group(name).threads, plan.group(name).cores
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        if cores:
            env["RLHF_CPU_CORES"] = ",".join(map(str, cores))  # the worker binds itself to them
        groups[name] = LearnerGroup(
            spec,
            placement_group=pgs[name],
            bundle_index=functools.partial(_bundle_of, pgs, name, plan.group(plan.group(name).share or name)),
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            timeout_s=timeout_s,
            env_vars=env | worker_env(),  # a thread count the user exported wins
        )
        stop_at_exit(groups[name].shutdown, actors=groups[name].actor_names(name))
    masters = get_all([g.workers[0].node_address.remote() for g in groups.values()], timeout_s=timeout_s)
    for g, master in zip(groups.values(), masters, strict=True):
        g.start_setup(master)
    return groups


def _bundle_of(pgs: PlacementGroups, name: str, host: GroupPlan, rank: int) -> int:
    """The bundle of ``name``'s placement group (its host's, when colocated) that rank ``rank`` sits on."""
    return pgs.bundle(name, host.bundle_index(rank))


def worker_env() -> dict[str, str]:
    """Environment for learner ranks and engines: this driver's thread and malloc settings where it has
    them, else how long their idle OpenMP threads spin (``runtime.openmp``) and malloc keeping freed memory
    (``runtime.malloc``; a cluster joined with ``--ray.address`` does not pass on the driver's environment)."""
    keep = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "TORCH_CPP_LOG_LEVEL", *MALLOC_SETTINGS)
    defaults = openmp_env(os.environ) | malloc_env(os.environ)
    return defaults | {k: os.environ[k] for k in keep if k in os.environ}
