"""Packed rows equal unpacked sequences (log-probs and gradients); row planning; balancing."""

from __future__ import annotations

import itertools

import pytest
import torch
from rlhf_learner.models import Actor, load_causal_lm
from rlhf_learner.packing import balance_micro_batches, for_kernel, pack_sequences, plan_rows, unpack


def _seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(3, 400, (n,), generator=g), "w": torch.randn(n, generator=g)}
        for n in lengths
    ]


@pytest.mark.parametrize("row", [20, 44], ids=["rows-of-20", "one-row"])  # one row: re-packed narrower
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_unpacked_logprobs_and_gradients(tiny_model_dir, attn, row):
    from rlhf_learner.models import ModelOptions

    actor = Actor(load_causal_lm(tiny_model_dir, options=ModelOptions(attn_implementation=attn)))
    seqs = _seqs([9, 3, 14, 6, 1, 11])
    packed = pack_sequences(seqs, max_tokens_per_row=row, pad_to_multiple=4)
    rows = packed.tensors
    assert rows["input_ids"].shape[0] < len(seqs)  # really packed: several sequences share a row
    out = actor(rows["input_ids"], position_ids=rows["position_ids"], return_entropy=True)
    loss = sum(
        (lp[1:] * s["w"][1:]).sum() for lp, s in zip(unpack(out.logp, packed.placement), seqs, strict=True)
    )
    actor.zero_grad()
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in actor.named_parameters()}

    actor.zero_grad()
    ref_loss = 0.0
    for i, s in enumerate(seqs):
        o = actor(s["input_ids"][None], return_entropy=True)
        got = unpack(out.logp, packed.placement)[i]
        torch.testing.assert_close(got, o.logp[0].detach(), atol=2e-5, rtol=0)
        torch.testing.assert_close(
            unpack(out.entropy, packed.placement)[i], o.entropy[0].detach(), atol=2e-5, rtol=0
        )
        ref_loss = ref_loss + (o.logp[0, 1:] * s["w"][1:]).sum()
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-4)
    for n, p in actor.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, atol=1e-4, rtol=1e-4, msg=n)


def test_rows_are_laid_out_for_the_kernel_and_outputs_put_back():
    seqs = _seqs([9, 3, 14, 6, 1, 11])
    t = pack_sequences(seqs, max_tokens_per_row=60, pad_to_multiple=8).tensors  # one row of 48
    ids, pos = t["input_ids"], t["position_ids"]
    narrow_ids, narrow_pos, back = for_kernel(ids, pos, attn_implementation="sdpa")
    assert narrow_ids.shape[1] == 14 and narrow_ids.shape[0] >= 4  # rows as wide as the longest
    assert all(narrow_pos[r, 0] == 0 for r in range(narrow_pos.shape[0]))
    assert torch.equal(back(narrow_ids[..., None].float())[..., 0].long()[:, :44], ids[:, :44])
    two = pack_sequences(seqs, max_tokens_per_row=20).tensors  # several rows
    flat_ids, flat_pos, back = for_kernel(
        two["input_ids"], two["position_ids"], attn_implementation="flash_attention_2"
    )
    assert flat_ids.shape == (1, two["input_ids"].numel()) and torch.equal(
        flat_pos.view(-1), two["position_ids"].view(-1)
    )
    assert torch.equal(back(flat_ids[..., None])[..., 0], two["input_ids"])
    same = for_kernel(two["input_ids"], two["position_ids"], attn_implementation="sdpa")  # already narrow
    assert same[0] is two["input_ids"]


def test_narrow_rows_keep_every_sequence_whole_and_put_every_token_back():
    """Random packings into one row or several (with and without padding tails; int64 or int32
    positions): each narrow row holds whole sequences (their tokens in order, positions 0..n-1) and then
    its tail, and ``back`` returns every token, tails included, to its place in the given rows."""
    g = torch.Generator().manual_seed(0)
    narrowed = 0
    for case in range(60):
        lens = torch.randint(1, 40, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        row = sum(lens) + 3 if case % 2 else 3 * max(lens)  # one row, or several
        t = pack_sequences(_seqs(lens, seed=case), max_tokens_per_row=row).tensors
        given = t["position_ids"].to(torch.int32 if case % 3 == 0 else torch.long)
        ids, pos, back = for_kernel(t["input_ids"], given, attn_implementation="eager")
        assert torch.equal(back(ids[..., None])[..., 0], t["input_ids"])
        assert torch.equal(back(pos[..., None])[..., 0], t["position_ids"])
        if ids is t["input_ids"]:
            continue
        narrowed += 1
        assert ids.shape[1] == max(lens + [n for n in _tails(t["position_ids"])])
        pieces = []  # every narrow row cut where positions restart: whole sequences, then the tail
        for r in range(ids.shape[0]):
            starts = [*(pos[r] == 0).nonzero().flatten().tolist(), ids.shape[1]]
            for a, b in itertools.pairwise(starts):
                assert torch.equal(pos[r, a:b], torch.arange(b - a))
                pieces.append(tuple(ids[r, a:b].tolist()))
        whole = [tuple(s["input_ids"].tolist()) for s in _seqs(lens, seed=case)]
        assert sorted(p for p in pieces if any(p)) == sorted(whole)  # the tails are all zeros
    assert narrowed >= 20


def _tails(position_ids):
    """Lengths of the rows' padding tails (the last span of a row that is not a sequence)."""
    out = []
    for r in range(position_ids.shape[0]):
        starts = (position_ids[r] == 0).nonzero().flatten().tolist()
        out.append(position_ids.shape[1] - starts[-1])
    return out


def test_pack_layout_and_unpack_roundtrip():
    seqs = _seqs([5, 2, 7])
    packed = pack_sequences(seqs, max_tokens_per_row=8, pad_values={"input_ids": 0})
    t = packed.tensors
    assert t["input_ids"].shape == (2, 7)  # rows [7] and [5, 2]: width of the fullest row
    for s, got in zip(seqs, unpack(t["input_ids"], packed.placement), strict=True):
        assert torch.equal(s["input_ids"], got)
    for s, got in zip(seqs, unpack(t["w"], packed.placement), strict=True):
        assert torch.equal(s["w"], got)
    for r, start, n in packed.placement:
        assert t["position_ids"][r, start : start + n].tolist() == list(range(n))


def test_plan_rows_rejects_sequences_longer_than_a_row():
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens"):
        plan_rows([3, 9], max_tokens_per_row=8)
    assert sorted(i for row in plan_rows([3, 5, 8, 1], max_tokens_per_row=8) for i in row) == [0, 1, 2, 3]


def test_balanced_micro_batches_are_token_balanced():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(16, 513, (64,), generator=g).tolist()
    groups = balance_micro_batches(lengths, 4)
    assert sorted(i for grp in groups for i in grp) == list(range(64))
    loads = [sum(lengths[i] for i in grp) for grp in groups]
    assert max(loads) - min(loads) <= max(lengths)
    assert max(loads) <= sum(lengths) / 4 + max(lengths)
    with pytest.raises(ValueError, match="cannot fill"):
        balance_micro_batches([5], 2)
