import math

import pytest
import torch
from rlhf_algos import dynamic_filter, masked_whiten, overlong_penalty, stop_penalty, vllm_is_weights


def test_dynamic_filter_drops_all_equal_groups():
    scores = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.5]])
    assert dynamic_filter(scores, low=0.0, high=1.0).tolist() == [False, False, True, True]
    with pytest.raises(ValueError, match="non-finite"):
        dynamic_filter(torch.tensor([[float("nan"), 1.0]]), low=0.0, high=1.0)
    with pytest.raises(ValueError, match="low < high"):
        dynamic_filter(scores, low=1.0, high=1.0)


def test_overlong_penalty_ramps_inside_the_buffer():
    lengths = torch.tensor([10, 16, 18, 20, 25])
    pen = overlong_penalty(lengths, max_length=20, buffer_length=4, penalty_factor=1.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


def test_stop_penalty_scales_or_replaces():
    r, t = torch.tensor([2.0, 2.0]), torch.tensor([True, False])
    torch.testing.assert_close(stop_penalty(r, t, coef=0.5), torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(stop_penalty(r, t, coef=-1.0), torch.tensor([-1.0, 2.0]))


def test_is_correction_modes():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1, 0.3], [0.5, 0.5, 0.5, 0.5]]))
    roll = torch.log(torch.tensor([[0.5, 0.3, 0.4, 0.3], [0.5, 0.5, 0.5, 0.5]]))
    # ratios: row 0 -> 1, 3, 0.25 ; row 1 -> 1, 1
    tis = vllm_is_weights(old, roll, mask, "tis", low=0.0, high=2.0)
    torch.testing.assert_close(tis, torch.tensor([[1.0, 2.0, 0.25, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    ice = vllm_is_weights(old, roll, mask, "icepop", low=0.5, high=2.0)
    torch.testing.assert_close(ice, torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    # geometric mean of row 0 = (1 * 3 * 0.25) ** (1/3) = 0.908 -> kept with [0.95, 2] only when low <= 0.908
    seq = vllm_is_weights(old, roll, mask, "seq-mask-tis", low=0.95, high=2.0)
    torch.testing.assert_close(seq, torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]))
    seq2 = vllm_is_weights(old, roll, mask, "seq-mask-tis", low=0.5, high=2.0)
    assert seq2[0, :3].tolist() == pytest.approx([1.0, 2.0, 0.25])
    assert math.isclose((3 * 0.25) ** (1 / 3), 0.9086, rel_tol=1e-3)


def test_is_correction_bad_input():
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="non-finite"):
        vllm_is_weights(torch.tensor([[0.0, float("nan")]]), torch.zeros(1, 2), mask, "tis")
    with pytest.raises(ValueError, match="unknown IS correction"):
        vllm_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), mask, "is")
    # an empty mask is fine: no weights
    assert (vllm_is_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), "icepop") == 0).all()


def test_masked_whiten_with_and_without_std():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    w = masked_whiten(x, mask)
    assert w[mask].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert w[mask].std().item() == pytest.approx(1.0, rel=1e-4)
    assert (w[~mask] == 0).all()
    centred = masked_whiten(x, mask, scale=False)
    torch.testing.assert_close(centred[mask], torch.tensor([-1.5, -0.5, 0.5, 1.5]))
    with pytest.raises(ValueError, match="selects no element"):
        masked_whiten(x, torch.zeros(2, 3))
