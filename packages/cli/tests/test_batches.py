"""The builders of rlhf-learner's micro-batches: every sample's tokens land in its row, packed or padded,
each field aligned with them, and the batches survive pickling (they cross Ray to the learner ranks)."""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import types

import pytest
import torch
from rlhf_cli.data.batches import (
    Sample,
    TeacherTargets,
    dpo_batch,
    kto_batch,
    policy_batch,
    reward_batch,
    sft_batch,
    sft_batch_from_examples,
    value_batch,
)
from rlhf_cli.data.examples import Example, KTOExample, PreferencePair
from rlhf_learner import DPOBatch, KTOBatch, PolicyBatch, RewardBatch, SFTBatch, ValueBatch


def _sample(length: int, prompt: int, seed: int) -> Sample:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(length) >= prompt
    return Sample(
        token_ids=torch.randint(3, 100, (length,), generator=g),
        action_mask=mask,
        rollout_logp=-torch.rand(length, generator=g) * mask,
        score=1.0,
        reward=1.0,
        truncated=False,
        prompt_index=seed,
        weight_version=1,
        old_logp=-torch.rand(length, generator=g),
        ref_logp=-torch.rand(length, generator=g),
        values=torch.randn(length, generator=g),
        advantages=torch.randn(length, generator=g),
        returns=torch.randn(length, generator=g),
    )


def _example(length: int, prompt: int, seed: int) -> Example:
    g = torch.Generator().manual_seed(seed)
    return Example(
        token_ids=torch.randint(3, 100, (length,), generator=g), loss_mask=torch.arange(length) >= prompt
    )


SAMPLES = [_sample(7, 3, 0), _sample(4, 2, 1), _sample(9, 4, 2)]
IDS = [s.token_ids for s in SAMPLES]


def _rows_of(batch, field: str, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """The values of ``field`` at each of ``sequences`` (token ids, in order), found in the batch's
    rows: packed (position ids restart per sequence; packing may reorder them) or padded."""
    values = getattr(batch, field)
    if batch.position_ids is not None:
        starts = [*(batch.position_ids[0] == 0).nonzero().flatten().tolist(), batch.input_ids.shape[1]]
        spans = [(0, a, b) for a, b in itertools.pairwise(starts)]
    else:
        spans = [(i, 0, int(batch.attention_mask[i].sum())) for i in range(values.shape[0])]
    out = []
    for k, ids in enumerate(sequences):
        (span,) = [(r, a, b) for r, a, b in spans if torch.equal(batch.input_ids[r, a:b], ids)]
        assert batch.position_ids is not None or span[0] == k  # padded: sequence k in row k
        out.append(values[span[0], span[1] : span[2]])
    assert len(out) == len(spans)
    return out


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_policy_and_value_batches_carry_every_sample_field(packing):
    batch = policy_batch(SAMPLES, packing=packing, with_ref=True, with_rollout=True)
    assert isinstance(batch, PolicyBatch)
    assert (batch.position_ids is not None) == packing and (batch.attention_mask is None) == packing
    for field, attr in [
        ("input_ids", "token_ids"),
        ("action_mask", "action_mask"),
        ("old_logp", "old_logp"),
        ("advantages", "advantages"),
        ("ref_logp", "ref_logp"),
        ("rollout_logp", "rollout_logp"),
    ]:
        for got, s in zip(_rows_of(batch, field, IDS), SAMPLES, strict=True):
            torch.testing.assert_close(got, getattr(s, attr).to(got.dtype))
    bare = policy_batch(SAMPLES, packing=packing, with_ref=False, with_rollout=False)
    assert bare.ref_logp is None and bare.rollout_logp is None
    value = value_batch(SAMPLES, packing=packing)
    assert isinstance(value, ValueBatch)
    for got, s in zip(_rows_of(value, "old_values", IDS), SAMPLES, strict=True):
        torch.testing.assert_close(got, s.values)
    for got, s in zip(_rows_of(value, "returns", IDS), SAMPLES, strict=True):
        torch.testing.assert_close(got, s.returns)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_teacher_targets_follow_their_tokens_into_the_rows(packing):
    """Dense distillation: the teacher's top-k row of each action token lands, in the batch's row-major
    order of action tokens, where that token does (packing may move the sequences)."""
    samples = [dataclasses.replace(s) for s in SAMPLES]
    for k, s in enumerate(samples):
        tag = (torch.arange(s.response_length, dtype=torch.int32) + 100 * k)[:, None].expand(-1, 3)
        s.teacher_top = TeacherTargets(logp=-tag.float(), ids=tag.clone())
    batch = policy_batch(samples, packing=packing, with_ref=False, with_rollout=False)
    assert batch.teacher_ids.shape == (sum(s.response_length for s in samples), 3)
    placed = torch.full(batch.action_mask.shape, -1, dtype=torch.int32)
    placed[batch.action_mask.bool()] = batch.teacher_ids[:, 0]
    layout = types.SimpleNamespace(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)})
    layout.placed = placed
    for k, (got, s) in enumerate(zip(_rows_of(layout, "placed", IDS), samples, strict=True)):
        assert got[s.action_mask].tolist() == list(range(100 * k, 100 * k + s.response_length))
        assert (got[~s.action_mask] == -1).all()
    torch.testing.assert_close(batch.teacher_logp, -batch.teacher_ids.float())
    samples[1].teacher_top = None
    with pytest.raises(ValueError, match="some samples have teacher targets"):
        policy_batch(samples, packing=packing, with_ref=False, with_rollout=False)
    samples[1].teacher_top = TeacherTargets(logp=torch.zeros(1, 3), ids=torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="teacher targets of sequence 1: 1 rows for its 2 target tokens"):
        policy_batch(samples, packing=packing, with_ref=False, with_rollout=False)


def test_a_sample_missing_a_field_is_named():
    incomplete = _sample(5, 2, 3)
    incomplete.advantages = None
    with pytest.raises(ValueError, match="policy_batch: sample has no advantages"):
        policy_batch([incomplete], packing=True, with_ref=False, with_rollout=False)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_sft_batches_train_on_the_response(packing):
    examples = [_example(6, 2, 4), _example(10, 5, 5)]
    batch = sft_batch_from_examples(examples, packing=packing)
    assert isinstance(batch, SFTBatch)
    for got, e in zip(_rows_of(batch, "loss_mask", [e.token_ids for e in examples]), examples, strict=True):
        assert torch.equal(got, e.loss_mask)
    from_samples = sft_batch(SAMPLES, packing=packing)
    for got, s in zip(_rows_of(from_samples, "loss_mask", IDS), SAMPLES, strict=True):
        assert torch.equal(got, s.action_mask)


def test_pair_batches_put_chosen_rows_then_rejected_rows():
    pairs = [
        PreferencePair(chosen=_example(6, 2, 6), rejected=_example(8, 2, 7)),
        PreferencePair(chosen=_example(5, 2, 8), rejected=_example(7, 2, 9)),
    ]
    order = [pairs[0].chosen, pairs[1].chosen, pairs[0].rejected, pairs[1].rejected]
    rm = reward_batch(pairs)
    assert isinstance(rm, RewardBatch) and rm.position_ids is None and rm.margin is None
    for got, e in zip(_rows_of(rm, "input_ids", [e.token_ids for e in order]), order, strict=True):
        assert torch.equal(got, e.token_ids)
    ref = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    dpo = dpo_batch(pairs, ref_logp=ref)
    assert isinstance(dpo, DPOBatch) and torch.equal(dpo.ref_logp, ref)
    for got, e in zip(_rows_of(dpo, "loss_mask", [e.token_ids for e in order]), order, strict=True):
        assert torch.equal(got, e.loss_mask)
    with pytest.raises(ValueError, match=r"DPOBatch.ref_logp: shape \(2,\), expected \(4,\)"):
        dpo_batch(pairs, ref_logp=ref[:2])


def test_kto_batch_rows_and_labels_survive_pickling():
    items = [
        KTOExample(example=_example(6, 2, 10), desirable=True, mismatched=_example(7, 2, 11)),
        KTOExample(example=_example(5, 3, 12), desirable=False, mismatched=_example(9, 3, 13)),
    ]
    batch = kto_batch(items, ref_logp=torch.tensor([-1.0, -2.0, -3.0, -4.0]))
    assert isinstance(batch, KTOBatch)
    assert batch.desirable.tolist() == [True, False]
    order = [items[0].example, items[1].example, items[0].mismatched, items[1].mismatched]
    for got, e in zip(_rows_of(batch, "input_ids", [e.token_ids for e in order]), order, strict=True):
        assert torch.equal(got, e.token_ids)
    back = pickle.loads(pickle.dumps(batch))
    assert type(back) is KTOBatch and back is not batch
    for field in ("input_ids", "attention_mask", "loss_mask", "ref_logp", "desirable"):
        assert torch.equal(getattr(back, field), getattr(batch, field))
