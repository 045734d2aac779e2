"""Batches between the recipe and the learner groups: one sample (:class:`Sample`), and builders of
rlhf-learner's typed micro-batch of each update step (rows packed where the step allows)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from rlhf_cli.data.images import ExampleImages, ImageInputs, ImageSequence
from rlhf_learner import (
    DistillBatch,
    DPOBatch,
    KTOBatch,
    PolicyBatch,
    RewardBatch,
    SFTBatch,
    ValueBatch,
    pack_sequences,
)

if TYPE_CHECKING:
    from rlhf_cli.data.examples import Example, KTOExample, PreferencePair

__all__ = [
    "Rows",
    "Sample",
    "TeacherTargets",
    "distill_batch",
    "dpo_batch",
    "example_rows",
    "kto_batch",
    "pad_stack",
    "policy_batch",
    "policy_rows",
    "reward_batch",
    "sft_batch",
    "sft_batch_from_examples",
    "to_rows",
    "value_batch",
]


@dataclass(kw_only=True)
class Sample:
    """One trajectory; every tensor is ``[T]`` aligned with ``token_ids`` (log-probs and values at
    column ``t`` describe the choice of token ``t``)."""

    token_ids: torch.Tensor
    action_mask: torch.Tensor
    """True on the tokens the policy sampled (the ones trained on)."""
    rollout_logp: torch.Tensor
    """The engine's log-probs of the sampled tokens (0 elsewhere; NaN where ``--rollout.logprobs false``
    asked for none)."""
    score: float
    """The reward source's score (what filters and pass rates read)."""
    reward: float
    """The sequence reward the advantages start from (score plus penalties)."""
    truncated: bool
    prompt_index: int
    weight_version: int
    """Version of the engine's weights that sampled it (the oldest, when several did)."""
    mixed_versions: bool = False
    """Its tokens were sampled by more than one weight version (an update landed mid-generation)."""
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None
    """The distillation teacher's log-probs of the sampled tokens (``--teacher.pretrain``)."""
    teacher_top: TeacherTargets | None = None
    """Dense distillation (``--algo.distill.top_k``): the teacher's top k at each sampled token."""
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    images: ImageInputs | None = None
    """The pixels of the images whose tokens ``token_ids`` holds (vision-language models)."""

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def scored(self) -> torch.Tensor | ImageSequence:
        """What a group's forward scores: the token ids, with the images when there are some."""
        return self.token_ids if self.images is None else ImageSequence(self.token_ids, self.images)

    @property
    def response_length(self) -> int:
        return int(self.action_mask.sum())


@dataclass(kw_only=True)
class Rows:
    """Sequences laid out as model rows: packed (``position_ids``) or right-padded (``attention_mask``)."""

    tensors: dict[str, torch.Tensor]
    placement: list[tuple[int, int, int]]
    """For each sequence: ``(row, start, length)``."""

    def split(self, value: torch.Tensor) -> list[torch.Tensor]:
        """A per-token ``[R, L]`` result back into one ``[T_i]`` tensor per sequence."""
        return [value[r, s : s + n] for r, s, n in self.placement]


def to_rows(
    sequences: Sequence[dict[str, torch.Tensor]],
    *,
    packing: bool,
    images: Sequence[ImageInputs | None] = (),
) -> Rows:
    """``sequences`` (dicts of equal-length 1-D tensors, ``input_ids`` among them) as rows: one packed
    row (``position_ids`` restart per sequence, no padding between them; the learner lays it out for its
    attention kernel) or right-padded rows. ``images``: each sequence's image pixels (or None). Packed
    rows with images are as wide as the longest sequence (the learner keeps their order: the pixels follow
    their tokens) and carry ``mm_token_type_ids``; the learner computes each sequence's M-RoPE positions."""
    if any(i is not None for i in images):
        return _image_rows(sequences, images, packing=packing)
    if packing:
        total = sum(int(s["input_ids"].shape[0]) for s in sequences)
        packed = pack_sequences(sequences, max_tokens_per_row=total)
        return Rows(tensors=packed.tensors, placement=packed.placement)
    width = max(int(s["input_ids"].shape[0]) for s in sequences)
    out = {k: pad_stack([s[k] for s in sequences], width) for k in sequences[0]}
    out["attention_mask"] = pad_stack([torch.ones_like(s["input_ids"]) for s in sequences], width)
    return Rows(
        tensors=out, placement=[(i, 0, int(s["input_ids"].shape[0])) for i, s in enumerate(sequences)]
    )


def _image_rows(
    sequences: Sequence[dict[str, torch.Tensor]], images: Sequence[ImageInputs | None], *, packing: bool
) -> Rows:
    if not packing:
        rows = to_rows(sequences, packing=False)
        width = rows.tensors["input_ids"].shape[1]
        return Rows(tensors=rows.tensors | ImageInputs.joined(images, width), placement=rows.placement)
    marked = [
        s | {"mm_token_type_ids": ImageInputs.kinds(i, len(s["input_ids"]))}
        for s, i in zip(sequences, images, strict=True)
    ]
    longest = max(len(s["input_ids"]) for s in sequences)
    packed = pack_sequences(marked, max_tokens_per_row=longest)
    order = sorted(
        range(len(images)), key=lambda i: packed.placement[i][:2]
    )  # as the tokens come, row by row
    pixels = ImageInputs.pixels([images[i] for i in order])
    return Rows(tensors=packed.tensors | pixels, placement=packed.placement)


def pad_stack(values: Sequence[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """Right-pad 1-D tensors with zeros to ``width`` (default: the longest) and stack them."""
    width = width or max(int(v.shape[0]) for v in values)
    out = torch.zeros((len(values), width), dtype=values[0].dtype)
    for i, v in enumerate(values):
        out[i, : v.shape[0]] = v
    return out


def _sample_rows(
    samples: Sequence[Sample], per_token: dict[str, str], *, packing: bool, what: str
) -> dict[str, torch.Tensor]:
    """Rows of ``samples``: ``input_ids`` plus, per ``{field: Sample attribute}``, that attribute."""
    return _sample_layout(samples, per_token, packing=packing, what=what).tensors


def _sample_layout(samples: Sequence[Sample], per_token: dict[str, str], *, packing: bool, what: str) -> Rows:
    images = [s.images for s in samples]
    where = _target_rows([s.action_mask for s in samples]) if "target_row" in per_token else []
    seqs = []
    for i, s in enumerate(samples):
        d = {"input_ids": s.token_ids}
        for out_name, attr in per_token.items():
            value = where[i] if out_name == "target_row" else getattr(s, attr)
            if value is None:
                raise ValueError(f"{what}: sample has no {attr}")
            d[out_name] = value
        seqs.append(d)
    return to_rows(seqs, packing=packing, images=images)


def policy_batch(
    samples: Sequence[Sample], *, packing: bool, with_ref: bool, with_rollout: bool
) -> PolicyBatch:
    """The micro-batch of ``ppo_actor_step`` (``ref_logp`` for a KL loss, ``rollout_logp`` for
    importance-sampling correction and the engine-vs-learner gap). Samples without ``old_logp`` (an
    exactly on-policy update) leave it unset: the step uses the current log-probs, detached."""
    return policy_rows(samples, packing=packing, with_ref=with_ref, with_rollout=with_rollout)[0]


def policy_rows(
    samples: Sequence[Sample], *, packing: bool, with_ref: bool, with_rollout: bool
) -> tuple[PolicyBatch, list[tuple[int, int, int]]]:
    """:func:`policy_batch` and each sample's ``(row, start, length)`` in it."""
    per_token = {"action_mask": "action_mask", "advantages": "advantages"}
    if any(s.old_logp is not None for s in samples):
        per_token["old_logp"] = "old_logp"
    if with_ref:
        per_token["ref_logp"] = "ref_logp"
    if with_rollout:
        per_token["rollout_logp"] = "rollout_logp"
    targets = [s.teacher_top for s in samples]
    if all(t is None for t in targets):
        rows = _sample_layout(samples, per_token, packing=packing, what="policy_batch")
        return PolicyBatch(**rows.tensors), rows.placement
    if any(t is None for t in targets):
        raise ValueError("policy_batch: some samples have teacher targets (teacher_top), others not")
    rows = _sample_layout(samples, per_token | {"target_row": ""}, packing=packing, what="policy_batch")
    tensors = dict(rows.tensors)
    order = tensors.pop("target_row")[tensors["action_mask"].bool()]
    logp, ids = _targets_in_order(targets, [s.action_mask for s in samples], order)  # type: ignore[arg-type]
    return PolicyBatch(**tensors, teacher_logp=logp, teacher_ids=ids), rows.placement


def _target_rows(masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per sequence ``[T]``: the index of each ``mask`` token among all the sequences' (-1 elsewhere), so
    that a layout that moves the sequences can put their per-token targets in its row-major order."""
    out, offset = [], 0
    for mask in masks:
        m = mask.bool()
        at = torch.full(m.shape, -1, dtype=torch.long)
        at[m] = torch.arange(offset, offset + int(m.sum()))
        out.append(at)
        offset += int(m.sum())
    return out


def _targets_in_order(
    targets: Sequence[TeacherTargets], masks: Sequence[torch.Tensor], order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets' ``(logp, ids)`` rows in ``order`` (``_target_rows``' indices as the layout holds
    them), checked one row per ``masks`` token."""
    for i, (t, m) in enumerate(zip(targets, masks, strict=True)):
        if t.logp.shape[0] != int(m.bool().sum()):
            raise ValueError(
                f"teacher targets of sequence {i}: {t.logp.shape[0]} rows for its {int(m.bool().sum())} "
                "target tokens"
            )
    return torch.cat([t.logp for t in targets])[order], torch.cat([t.ids for t in targets])[order]


def value_batch(samples: Sequence[Sample], *, packing: bool) -> ValueBatch:
    """The micro-batch of ``critic_step``."""
    per_token = {"action_mask": "action_mask", "old_values": "values", "returns": "returns"}
    return ValueBatch(**_sample_rows(samples, per_token, packing=packing, what="value_batch"))


def sft_batch(samples: Sequence[Sample], *, packing: bool) -> SFTBatch:
    """``sft_step`` on trajectories: the loss is on their sampled tokens."""
    return SFTBatch(**_sample_rows(samples, {"loss_mask": "action_mask"}, packing=packing, what="sft_batch"))


def sft_batch_from_examples(examples: Sequence[Example], *, packing: bool) -> SFTBatch:
    """``sft_step`` on training examples: the loss is on their ``loss_mask`` tokens."""
    return SFTBatch(**example_rows(examples, packing=packing))


def example_rows(examples: Sequence[Example], *, packing: bool) -> dict[str, torch.Tensor]:
    """``input_ids``, ``loss_mask`` and ``attention_mask`` or ``position_ids`` of training examples."""
    return to_rows(
        [{"input_ids": e.token_ids, "loss_mask": e.loss_mask} for e in examples],
        packing=packing,
        images=_pixels_made([e.images for e in examples]),
    ).tensors


def _pixels_made(images: Sequence[ExampleImages | None]) -> list[ImageInputs | None]:
    """Each example's images with their pixels made now, once for examples that share their images (a
    preference pair's two responses)."""
    made: dict[int, ImageInputs] = {}
    for x in images:
        if x is not None and id(x.images) not in made:
            made[id(x.images)] = x.inputs()
    return [
        None if x is None else dataclasses.replace(made[id(x.images)], positions=x.positions) for x in images
    ]


def _pair_rows(pairs: Sequence[PreferencePair]) -> dict[str, torch.Tensor]:
    """``2P`` padded rows, the chosen responses then the rejected ones (the steps read one score or
    sum per row)."""
    return example_rows([p.chosen for p in pairs] + [p.rejected for p in pairs], packing=False)


def reward_batch(pairs: Sequence[PreferencePair]) -> RewardBatch:
    """The micro-batch of ``reward_model_step``."""
    rows = _pair_rows(pairs)
    return RewardBatch(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"])


def dpo_batch(pairs: Sequence[PreferencePair], *, ref_logp: torch.Tensor) -> DPOBatch:
    """The micro-batch of ``dpo_step``; ``ref_logp`` ``[2P]``: the reference's summed response
    log-probs, chosen then rejected."""
    return DPOBatch(**_pair_rows(pairs), ref_logp=ref_logp)


def kto_batch(examples: Sequence[KTOExample], *, ref_logp: torch.Tensor) -> KTOBatch:
    """The micro-batch of ``kto_step``: ``N`` example rows then their ``N`` mismatched rows (padded);
    ``ref_logp`` ``[2N]`` in that order."""
    rows = [e.example for e in examples] + [e.mismatched for e in examples]
    return KTOBatch(
        **example_rows(rows, packing=False),
        ref_logp=ref_logp,
        desirable=torch.tensor([e.desirable for e in examples], dtype=torch.bool),
    )


@dataclass(frozen=True, kw_only=True)
class TeacherTargets:
    """The teacher's next-token distribution at each target (``loss_mask``) token of one example."""

    logp: torch.Tensor
    """``[n, K]`` log-probs of ``ids``: the teacher's top k, or the whole vocabulary."""
    ids: torch.Tensor
    """``[n, K]`` token ids (int32)."""
    token_logp: torch.Tensor | None = None
    """``[T]`` the teacher's log-probs of the sequence's own tokens (on-policy distillation), or None."""


def distill_batch(
    token_ids: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    targets: Sequence[TeacherTargets],
    *,
    packing: bool,
) -> tuple[DistillBatch, Rows]:
    """The micro-batch of ``distill_step`` (and where each sequence's tokens went): the sequences' rows,
    and their teacher targets in the rows' order of target tokens (packing may move the sequences)."""
    where = _target_rows(loss_masks)
    seqs = [
        {"input_ids": ids, "loss_mask": mask, "target_row": at}
        for ids, mask, at in zip(token_ids, loss_masks, where, strict=True)
    ]
    rows = to_rows(seqs, packing=packing)
    tensors = dict(rows.tensors)
    order = tensors.pop("target_row")[tensors["loss_mask"].bool()]
    logp, ids = _targets_in_order(targets, loss_masks, order)
    return DistillBatch(**tensors, teacher_logp=logp, teacher_ids=ids), Rows(
        tensors=tensors, placement=rows.placement
    )
