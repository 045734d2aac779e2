"""The experience stage of a PPO step: the learner groups score the samples (old-policy and reference
log-probs, values), rlhf-algos turns scores into advantages and returns."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from rlhf_algos import (
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    approx_kl,
    compute_advantages,
    distill_advantages,
    masked_mean,
    reverse_kl,
)
from rlhf_cli.data.batches import Sample, TeacherTargets, pad_stack
from rlhf_cli.ppo.settings import Batching, ExperienceSettings
from rlhf_cli.runtime.learners.late_reference import PendingScores
from rlhf_cli.runtime.learners.protocols import ScoringGroup, TeacherGroup

__all__ = ["Experience", "make_experience", "make_kl_controller", "score_reference"]


@dataclass(kw_only=True)
class Experience:
    """The samples with ``old_logp`` / ``ref_logp`` / ``values`` / ``advantages`` / ``returns`` filled in,
    and what the stage measured."""

    samples: list[Sample]
    kl_mean: float | None
    """Mean per-token KL to the reference over the sampled tokens (None without a reference, or when the
    old-policy forward was skipped: the update step measures it then)."""
    kl_coef: float
    with_reference: bool
    logp_mismatch_mean: float | None
    """Engine-vs-learner log-prob gap on the sampled tokens (None when the old-policy forward was
    skipped: the update step measures it then)."""
    logp_mismatch_max: float | None
    advantage_mean: float
    advantage_abs_mean: float
    old_policy_s: float
    """Seconds of the actor's old-policy forward (0 when skipped)."""
    reference_s: float | None
    """Seconds of the reference forward (None: the producer ran it, see ``RolloutBatch.reference_s``, or
    it overlaps the update: ``pending_reference``)."""
    values_s: float
    """Seconds of the critic's forward."""
    advantages_s: float
    teacher_s: float | None = None
    """Seconds of the teacher's forward (None: no teacher, or the reference group is the teacher and its
    one forward serves both; dense distillation runs a forward of its own on it)."""
    reverse_kl: float | None = None
    """On-policy distillation: the student's reverse KL to the teacher per sampled token."""
    pending_reference: PendingScores | None = None
    """The reference forward, started and not waited for: the actor's ranks fetch its log-probs in the
    update (``--train.overlap_reference``); the samples' ``ref_logp`` stay unset."""

    @property
    def forward_s(self) -> float:
        """The actor's and critic's forwards (the learner's share of this stage)."""
        return self.old_policy_s + self.values_s

    def metrics(self) -> dict[str, float]:
        out = {
            "advantages/mean": self.advantage_mean,
            "advantages/abs_mean": self.advantage_abs_mean,
            "time/old_policy": self.old_policy_s,
            "time/values": self.values_s,
            "time/advantages": self.advantages_s,
        }
        if self.reference_s is not None:
            out["time/reference"] = self.reference_s
        if self.teacher_s is not None:
            out["time/teacher"] = self.teacher_s
        if self.reverse_kl is not None:
            out["distill/reverse_kl"] = self.reverse_kl
        if self.logp_mismatch_mean is not None:
            out |= {
                "sync/logp_mismatch_mean": self.logp_mismatch_mean,
                "sync/logp_mismatch_max": self.logp_mismatch_max,
            }
        if self.kl_mean is not None:
            out["policy/kl"] = self.kl_mean
        if self.with_reference:
            out["policy/kl_coef"] = self.kl_coef
        return out


def make_kl_controller(
    *, value: float, target: float | None, horizon: int
) -> AdaptiveKLController | FixedKLController:
    """Adaptive (Ziegler et al. 2019) when a ``target`` KL is set (``--algo.kl.target``), else fixed at
    ``value``."""
    if target is not None:
        return AdaptiveKLController(value=value, target=target, horizon=horizon)
    return FixedKLController(value=value)


def _scores(
    groups: Sequence[ScoringGroup | None], seqs: list[torch.Tensor], batching: Batching, *, concurrent: bool
) -> list[tuple[list | None, float]]:
    """Each group's per-sequence forward (None for a missing group) and its seconds: one after the other
    (each then has the cores or devices to itself), or all started at once when ``concurrent``."""
    kw = {"micro_batch_size": batching.micro_batch_size, "packing": batching.packing}
    out: list[tuple[list | None, float]] = []
    if concurrent:
        t0 = time.perf_counter()
        waits = [g.submit_forward(seqs, **kw) if g is not None else None for g in groups]
        for wait in waits:
            out.append((wait(), time.perf_counter() - t0) if wait is not None else (None, 0.0))
        return out
    for g in groups:
        t0 = time.perf_counter()
        out.append((g.forward(seqs, **kw), time.perf_counter() - t0) if g is not None else (None, 0.0))
    return out


def _advantages(
    settings: ExperienceSettings,
    samples: Sequence[Sample],
    mask: torch.Tensor,
    *,
    kl: Any,
    with_values: bool,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of the configured estimator (rlhf-algos), each ``[B, T]``."""
    a = settings
    inputs = AdvantageInputs(
        scores=torch.tensor([s.reward for s in samples]),
        mask=mask,
        n_samples_per_prompt=a.n_samples_per_prompt,
        kl=kl,
        values=pad_stack([s.values for s in samples]) if with_values else None,
    )
    shaping = kl_coef if a.kl_in_reward else 0.0
    return compute_advantages(
        a.estimator, inputs, gamma=a.gamma, lam=a.lam, kl_coef=shaping, reward_clip=a.reward_clip
    )


def score_reference(batching: Batching, samples: Sequence[Sample], ref: ScoringGroup) -> float:
    """Fill each sample's reference log-probs (they depend on the samples alone, so an asynchronous run
    computes them in the producer, beside generation); returns the seconds it took."""
    ((logp, seconds),) = _scores([ref], [s.scored for s in samples], batching, concurrent=False)
    for s, lp in zip(samples, logp, strict=True):
        s.ref_logp = lp
    return seconds


@dataclass(frozen=True)
class _DenseTeacher:
    """A teacher group scoring for dense distillation (``--algo.distill.top_k``): its "forward" gives each
    sequence's :class:`TeacherTargets`, its top k at the sampled tokens and its log-probs of every token."""

    group: TeacherGroup
    masks: list[torch.Tensor]
    top_k: int
    vocab: int | None
    """The student's vocabulary (a teacher's padded embedding is cut to it)."""

    def submit_forward(self, seqs: list, *, micro_batch_size: int, packing: bool) -> Any:
        """Start the teacher's targets of ``seqs`` at their sampled tokens; the returned call waits."""
        del packing  # (the teacher's rows hold one sequence each: its targets come in sequence order)
        return self.group.submit_teacher_targets(
            seqs,
            self.masks,
            micro_batch_size=micro_batch_size,
            top_k=self.top_k,
            vocab=self.vocab,
            token_logp=True,
        )

    def forward(self, seqs: list, *, micro_batch_size: int, packing: bool) -> list[TeacherTargets]:
        """The teacher's targets of ``seqs``, waited for."""
        return self.submit_forward(seqs, micro_batch_size=micro_batch_size, packing=packing)()


def _teacher_scorer(
    settings: ExperienceSettings,
    samples: Sequence[Sample],
    *,
    actor: ScoringGroup,
    ref: ScoringGroup | None,
    teacher: ScoringGroup | None,
) -> Any:
    """What scores the samples for the teacher: its group (None when it is the reference group, whose
    one forward serves both), or for dense distillation :class:`_DenseTeacher`."""
    if teacher is None or settings.distill_top_k is None:
        return teacher if teacher is not ref else None
    masks = [s.action_mask for s in samples]
    return _DenseTeacher(teacher, masks, top_k=settings.distill_top_k, vocab=actor.spec.text_vocab)


def _fill(samples: Sequence[Sample], scores: list[list | None], *, teacher_is_ref: bool) -> None:
    """Each sample's old-policy, reference, critic and teacher scores (``_scores``' order)."""
    old, ref_logp, values, teacher = scores
    for i, s in enumerate(samples):
        s.old_logp = old[i] if old is not None else None
        if ref_logp is not None:
            s.ref_logp = ref_logp[i]
        if values is not None:
            s.values = values[i]
        if teacher is not None and isinstance(teacher[i], TeacherTargets):
            s.teacher_top, s.teacher_logp = teacher[i], teacher[i].token_logp
        elif teacher is not None or teacher_is_ref:
            s.teacher_logp = s.ref_logp if teacher_is_ref else teacher[i]


def _distilled(
    settings: ExperienceSettings,
    samples: Sequence[Sample],
    mask: torch.Tensor,
    adv: torch.Tensor,
    old: torch.Tensor | None,
) -> tuple[torch.Tensor, float]:
    """The advantages plus on-policy distillation's (rlhf-algos' ``distill_advantages``, weighted by
    ``settings.distill_coef``), and the student's reverse KL to the teacher. The student's log-probs are
    the old-policy forward's: a run with a teacher never skips it (``PPOConfig.exactly_on_policy``)."""
    if old is None:
        raise ValueError("on-policy distillation needs the old-policy forward (settings.on_policy is set)")
    teacher = pad_stack([s.teacher_logp for s in samples])
    if settings.distill_top_k is not None:  # dense: the update's loss holds the teacher's term
        return adv, float(reverse_kl(old, teacher, mask))
    extra = distill_advantages(old, teacher, mask, discount=settings.distill_discount)
    return adv + settings.distill_coef * extra, float(reverse_kl(old, teacher, mask))


def make_experience(
    settings: ExperienceSettings,
    samples: Sequence[Sample],
    *,
    actor: ScoringGroup,
    ref: ScoringGroup | None,
    critic: ScoringGroup | None,
    kl_coef: float,
    concurrent: bool = False,
    teacher: ScoringGroup | None = None,
) -> Experience:
    """Score the samples and compute advantages and returns. The old-policy forward is skipped when the
    update is exactly on-policy (``settings.on_policy``): the update step then uses the current
    log-probs, detached, and measures the KL and the engine gap itself. ``concurrent``: the groups sit on
    different devices, so their forwards overlap. With ``settings.overlap_reference`` the reference forward
    is started first and not waited for (``Experience.pending_reference``). A ``teacher``'s log-probs add
    on-policy distillation's advantage (``_distilled``)."""
    seqs = [s.scored for s in samples]
    scored = ref is not None and all(s.ref_logp is not None for s in samples)  # by the producer (async)
    pending = None
    b = settings.batching
    if ref is not None and not scored and settings.overlap_reference:
        pending = ref.start_forward(seqs, micro_batch_size=b.micro_batch_size, packing=b.packing)
    own_teacher = _teacher_scorer(settings, samples, actor=actor, ref=ref, teacher=teacher)
    old_policy = None if settings.on_policy else actor
    groups = (old_policy, None if scored or pending is not None else ref, critic, own_teacher)
    scores = _scores(groups, seqs, b, concurrent=concurrent)
    (old, t_actor), (_, t_ref), (_, t_critic), (_, t_teacher) = scores
    _fill(samples, [logp for logp, _ in scores], teacher_is_ref=teacher is not None and own_teacher is None)
    t0 = time.perf_counter()
    mask = pad_stack([s.action_mask for s in samples])
    old_t = pad_stack([s.old_logp for s in samples]) if old is not None else None
    kl = None
    if ref is not None and old_t is not None and pending is None:
        kl = approx_kl(old_t, pad_stack([s.ref_logp for s in samples]), settings.kl_estimator)
    adv, ret = _advantages(settings, samples, mask, kl=kl, with_values=critic is not None, kl_coef=kl_coef)
    adv, reverse = _distilled(settings, samples, mask, adv, old_t) if teacher else (adv, None)
    for i, s in enumerate(samples):
        s.advantages, s.returns = adv[i, : s.length].clone(), ret[i, : s.length].clone()
    gap = None
    if old_t is not None and settings.engine_logprobs:
        gap = (old_t - pad_stack([s.rollout_logp for s in samples])).abs()[mask.bool()]
    return Experience(
        samples=list(samples),
        kl_mean=float(masked_mean(kl, mask)) if kl is not None else None,
        kl_coef=kl_coef,
        with_reference=ref is not None,
        logp_mismatch_mean=float(gap.mean()) if gap is not None else None,
        logp_mismatch_max=float(gap.max()) if gap is not None else None,
        advantage_mean=float(masked_mean(adv, mask)),
        advantage_abs_mean=float(masked_mean(adv.abs(), mask)),
        old_policy_s=t_actor,
        reference_s=None if scored or pending is not None else t_ref,
        values_s=t_critic,
        advantages_s=time.perf_counter() - t0,
        teacher_s=t_teacher if own_teacher is not None else None,
        reverse_kl=reverse,
        pending_reference=pending,
    )
