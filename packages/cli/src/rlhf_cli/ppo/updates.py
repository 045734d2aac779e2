"""The update stage of a PPO step: samples -> per-rank typed micro-batches -> actor and critic updates."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from rlhf_cli.data.batches import Sample, policy_rows, value_batch
from rlhf_cli.ppo.settings import UpdateSettings
from rlhf_cli.runtime.learners.late_reference import PendingScores, Placement
from rlhf_cli.runtime.learners.protocols import PolicyGroup, ScoringGroup, ValueGroup
from rlhf_cli.runtime.learners.specs import ValueLossSettings
from rlhf_cli.runtime.runs.failures import naming_nonfinite
from rlhf_learner import PolicyBatch, StepResult, balance_micro_batches

__all__ = ["Updates", "mean_result", "micro_batches", "mini_batches", "update"]

B = TypeVar("B")


@dataclass(kw_only=True)
class Updates:
    """The step's actor and critic results (means over its optimizer steps) and the stage's seconds."""

    actor: StepResult | None
    """None: the actor was frozen this step (``--train.freeze_actor_steps``)."""
    critic: StepResult | None
    optimizer_steps: int
    actor_s: float
    critic_s: float

    @property
    def seconds(self) -> float:
        return self.actor_s + self.critic_s

    on_policy: bool = False
    """The old-policy forward was skipped: the step measured the KL and the engine gap."""

    @property
    def kl_mean(self) -> float | None:
        """The KL loss term's mean per token (None when KL is no loss): with an exactly on-policy update
        the step measures the KL the experience stage did not."""
        return self.actor.metrics.get("kl") if self.actor is not None else None

    def metrics(self) -> dict[str, float]:
        out = {"actor/optimizer_steps": float(self.optimizer_steps)}
        out |= {"time/actor_update": self.actor_s, "time/critic_update": self.critic_s}
        if self.critic is not None:
            out |= {
                "critic/loss": self.critic.loss,
                **{f"critic/{k}": v for k, v in self.critic.metrics.items()},
            }
        if self.actor is None:
            return out
        a = dict(self.actor.metrics)
        out["actor/loss"] = self.actor.loss
        if "logp_mismatch" in a:  # the engine's log-probs against the policy the update started from
            out["sync/logp_mismatch_mean"] = a.pop("logp_mismatch")
            out["sync/logp_mismatch_max"] = a.pop("logp_mismatch_max")
        if self.on_policy and "kl" in a:
            out["policy/kl"] = a["kl"]
        out |= {f"actor/{k}": v for k, v in a.items()}
        if self.actor.grad_norm is not None:
            out["actor/grad_norm"] = self.actor.grad_norm
        return out


def mean_result(results: Sequence[StepResult]) -> StepResult:
    """The mean of several optimizer steps' results (``_max`` metrics: their maximum)."""
    if len(results) == 1:
        return results[0]
    n = len(results)
    metrics = {}
    for k in results[0].metrics:
        vals = [r.metrics[k] for r in results]
        metrics[k] = max(vals) if k.endswith("_max") else sum(vals) / n
    norms = [r.grad_norm for r in results if r.grad_norm is not None]
    return StepResult(
        loss=sum(r.loss for r in results) / n,
        grad_norm=sum(norms) / len(norms) if norms else None,
        metrics=metrics,
    )


def micro_batches(
    samples: Sequence[Sample],
    group: ScoringGroup,
    *,
    micro_batch_size: int,
    dynamic: bool,
    build: Callable[[list[Sample]], B],
) -> list[list[B]]:
    """Each rank's shard cut into ``len(shard) / micro_batch_size`` micro-batches: equal sample counts,
    or (``dynamic``) near-equal token counts."""
    out = []
    for shard in group.shards(samples):
        count = len(shard) // micro_batch_size
        if dynamic:
            parts = balance_micro_batches([s.length for s in shard], count)
        else:
            parts = [list(range(i * micro_batch_size, (i + 1) * micro_batch_size)) for i in range(count)]
        out.append([build([shard[i] for i in part]) for part in parts])
    return out


def update_policy(
    settings: UpdateSettings,
    samples: Sequence[Sample],
    actor: PolicyGroup,
    *,
    kl_coef: float,
    reference: PendingScores | None = None,
    index: Mapping[int, int] | None = None,
) -> StepResult:
    """One optimizer step of the actor on ``samples`` (a mini-batch). ``reference``: the reference forward
    still running, whose results the actor's ranks fetch (the samples have no ``ref_logp``); ``index``
    maps ``id(sample)`` to the sample's position in what it scores."""
    loss, b = settings.policy(kl_coef), settings.batching
    with_ref = loss.kl_loss_coef > 0
    gap_here = settings.engine_logprobs and samples[0].old_logp is None  # the engines' gap, measured here
    with_rollout = loss.is_correction != "none" or gap_here
    late = with_ref and reference is not None

    def build(part: list[Sample]) -> tuple[PolicyBatch, list[Placement]]:
        batch, rows = policy_rows(
            part, packing=b.packing, with_ref=with_ref and not late, with_rollout=with_rollout
        )
        return batch, ([(index[id(s)], *p) for s, p in zip(part, rows, strict=True)] if late else [])

    built = micro_batches(samples, actor, micro_batch_size=b.micro_batch_size, dynamic=b.dynamic, build=build)
    batches = [[b for b, _ in mbs] for mbs in built]
    if not late:
        return actor.train_policy(batches, settings=loss)
    assert reference is not None
    per_rank = [reference.for_rank([p for _, p in mbs]) for mbs in built]
    return actor.train_policy(batches, settings=loss, reference=(reference, per_rank))


def update_critic(settings: UpdateSettings, samples: Sequence[Sample], critic: ValueGroup) -> StepResult:
    """One optimizer step of the critic on ``samples`` (a mini-batch)."""
    b = settings.batching
    batches = micro_batches(
        samples,
        critic,
        micro_batch_size=b.micro_batch_size,
        dynamic=b.dynamic,
        build=lambda part: value_batch(part, packing=b.packing),
    )
    return critic.train_value(batches, settings=ValueLossSettings(clip_eps=settings.value_clip_eps))


def mini_batches(
    settings: UpdateSettings, samples: Sequence[Sample], *, step: int, epoch: int
) -> list[list[Sample]]:
    """``samples`` cut into mini-batches of ``--train.batch_size`` after a shuffle seeded by the run's
    seed, the step and the pass (no shuffle when the whole batch is one mini-batch)."""
    size = settings.mini_batch_size
    if size >= len(samples):
        return [list(samples)]
    g = torch.Generator().manual_seed(settings.seed * 1_000_003 + step * 1_009 + epoch)
    order = torch.randperm(len(samples), generator=g).tolist()
    return [[samples[i] for i in order[lo : lo + size]] for lo in range(0, len(samples), size)]


def update(
    settings: UpdateSettings,
    samples: Sequence[Sample],
    *,
    actor: PolicyGroup,
    critic: ValueGroup | None,
    kl_coef: float,
    step: int = 0,
    reference: PendingScores | None = None,
) -> Updates:
    """``--train.ppo_epochs`` passes over the samples, one actor (and critic) optimizer step per
    mini-batch (OpenRLHF's and verl's PPO semantics); the critic's alone for the first
    ``--train.freeze_actor_steps`` steps. ``reference``: the reference forward of ``samples``, still
    running (``Experience.pending_reference``)."""
    if reference is not None and sum(reference.lengths) != len(samples):
        raise ValueError(
            f"reference: scored {sum(reference.lengths)} sequences, the update has {len(samples)}"
        )
    actor_results, critic_results, seconds = [], [], [0.0, 0.0]
    index = {id(s): i for i, s in enumerate(samples)}
    for epoch in range(settings.ppo_epochs):
        for i, part in enumerate(mini_batches(settings, samples, step=step, epoch=epoch)):
            t0 = time.perf_counter()
            where = f"step {step}, epoch {epoch + 1}, mini-batch {i + 1}"
            if not 0 < step <= settings.freeze_actor_steps:  # frozen: the critic's warm-up
                with naming_nonfinite(f"{where}: actor"):
                    actor_results.append(
                        update_policy(
                            settings, part, actor, kl_coef=kl_coef, reference=reference, index=index
                        )
                    )
            t1 = time.perf_counter()
            if critic is not None:
                with naming_nonfinite(f"{where}: critic"):
                    critic_results.append(update_critic(settings, part, critic))
            seconds[0], seconds[1] = seconds[0] + t1 - t0, seconds[1] + time.perf_counter() - t1
    return Updates(
        actor=mean_result(actor_results) if actor_results else None,
        critic=mean_result(critic_results) if critic_results else None,
        optimizer_steps=len(actor_results),
        actor_s=seconds[0],
        critic_s=seconds[1],
        on_policy=samples[0].old_logp is None,
    )
